"""A run's output on any fsspec filesystem: unit files, commit markers, plan, manifest.

Layout under <output.path>/<run_id>/ (names depend only on run id and unit id, never on an attempt):

    config.yaml, _plan.json             resolved config (credentials redacted) and the unit plan
    _staging/<unit>/<kind>.parquet      a unit's data while it is being written (invisible)
    _committed/<unit>.json              the commit marker: the single write that makes a unit exist
    completions|rounds|errors/<unit>.parquet   published data of committed units
    manifest.json, _SUCCESS             written last, with totals and every file

Commit protocol: (1) write the three files to _staging, (2) write the marker atomically (one PUT on
object stores; temp file + fsync + rename on local disks, so a full disk or a crash never leaves a
torn marker), (3) publish = move staging files to their final names. A crash before (2) leaves only
staging files, which readers never list (names starting with "_" are skipped by pyarrow, pandas and
`datasets`) and the retry overwrites; a crash between (2) and (3) is rolled forward by the next run
or the finalizer. So published folders only ever hold committed units, each exactly once. Readers
that go through the markers (`committed_files`, `report.load`) find a committed unit's data in its
final place or, while publishing is unfinished, in _staging. A marker that cannot be parsed (written
by hand, or by an older version in place) counts as not committed: warned, and the unit runs again.

Every storage call is retried with bounded backoff (`storage.retries`); an error that outlasts the
retries names the operation and path.

Knows nothing about models or Ray.
"""
from __future__ import annotations

import json
import logging
import posixpath
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from .reader import Unit, filesystem
from .schema import TABLES
from .storage import StorageConfig, StorageError, describe, put_atomic, retrying

KINDS = tuple(TABLES)
log = logging.getLogger(__name__)


class OutputError(RuntimeError):
    """The output folder holds a different run, or a marker is inconsistent."""


class RunOutput:
    def __init__(self, root: str, run_id: str, storage: StorageConfig, compression: str = "zstd"):
        self.url = f"{root.rstrip('/')}/{run_id}"
        self.fs, self.path = filesystem(self.url, storage)
        self.compression = None if compression == "none" else compression
        self.retry = storage.retry_policy()
        self._protocol = self.url.split("://")[0] + "://" if "://" in self.url else ""

    # ---- paths ------------------------------------------------------------------------------
    def _p(self, *parts: str) -> str:
        return posixpath.join(self.path, *parts)

    def url_of(self, rel: str) -> str:
        return f"{self._protocol}{self._p(rel)}" if self._protocol else self._p(rel)

    @property
    def lease_folder(self) -> str:
        return self._p("_lease")

    @staticmethod
    def data_rel(kind: str, uid: str) -> str:
        return f"{kind}/{uid}.parquet"

    # ---- plan -------------------------------------------------------------------------------
    def check_location(self) -> None:
        """The run folder must be creatable: no file where a folder of its path should be."""
        path = self.path
        while path and path not in ("/", "."):
            if self._io(f"check {path}", lambda p=path: self.fs.isfile(p)):
                raise OutputError(f"output {self.url}: {self._protocol}{path} is a file; "
                                  f"output.path must be a folder (or a bucket prefix)")
            parent = posixpath.dirname(path)
            path = parent if parent != path else ""

    def prepare(self, units: list[Unit], chash: str, config_tree: dict, hashed_tree: dict,
                resume: bool) -> None:
        """Record the plan on a new run; on an existing one, check it is the same job (a refused
        config names the keys that differ)."""
        plan = {"config_hash": chash, "units": [u.uid for u in units], "config": hashed_tree}
        old = self._read_json("_plan.json")
        if old is not None:
            if not resume:
                raise OutputError(f"{self.url} already holds a run; use a new run.run_id or run.resume=true")
            if old["config_hash"] != chash:
                raise OutputError(f"{self.url} holds a run with another config ({self._config_diff(old, hashed_tree)}); "
                                  f"use a new run.run_id, or the recorded values to resume it")
            if old["units"] != plan["units"]:
                raise OutputError(f"{self.url}: the input now plans different units than the "
                                  f"recorded run; use a new run.run_id")
            return
        self._io(f"create {self.url}", lambda: self.fs.makedirs(self.path, exist_ok=True))
        self._put("config.yaml", yaml.safe_dump(config_tree, sort_keys=False).encode())
        self._put("_plan.json", json.dumps(plan).encode())

    def plan(self) -> dict | None:
        """The recorded plan ({config_hash, units, config}); None when the folder holds no run."""
        return self._read_json("_plan.json")

    def _config_diff(self, old_plan: dict, new_tree: dict) -> str:
        if "config" not in old_plan:           # a plan that holds only the hash
            return f"recorded hash {old_plan['config_hash']}"
        diffs = _diff(old_plan["config"], new_tree)
        shown = "; ".join(f"{k}: recorded {a!r}, now {b!r}" for k, a, b in diffs[:8])
        return shown + (f" (+{len(diffs) - 8} more)" if len(diffs) > 8 else "")

    def _io(self, what: str, op: Callable):
        return retrying(self.retry, what, op)

    def _put(self, rel: str, data: bytes) -> None:
        self._io(f"write {self.url_of(rel)}", lambda: put_atomic(self.fs, self._p(rel), data))

    def _read_json(self, rel: str) -> dict | None:
        """The JSON object at rel; None if it does not exist."""
        def read():
            try:
                return self.fs.cat_file(self._p(rel))
            except FileNotFoundError:
                return None
        data = self._io(f"read {self.url_of(rel)}", read)
        return None if data is None else json.loads(data)

    # ---- units ------------------------------------------------------------------------------
    def committed(self) -> dict[str, dict]:
        """uid -> marker of every committed unit. A marker that does not parse is warned about and
        counts as not committed (its unit runs again and rewrites it)."""
        out = {}
        paths = self._io(f"list {self.url_of('_committed')}", lambda: self.fs.glob(self._p("_committed", "*.json")))
        for m in paths:
            data = self._io(f"read {m}", lambda m=m: self.fs.cat_file(m))
            try:
                marker = json.loads(data)
                out[marker["unit"]] = marker
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring invalid commit marker %s (%s); its unit counts as not committed",
                            m, describe(e))
        return out

    def is_committed(self, uid: str) -> bool:
        try:
            marker = self._read_json(f"_committed/{uid}.json")
        except ValueError:
            return False
        return isinstance(marker, dict) and marker.get("unit") == uid

    def write_unit(self, uid: str, tables: dict[str, pa.Table], marker: dict,
                   before_commit: Callable[[], None] | None = None) -> dict:
        """Stage, commit, publish. Returns the marker written. Once the marker is written the unit is
        committed: a publish that fails is left to the next roll-forward (readers find the staged
        data meanwhile), not reported as a failed unit."""
        for kind in KINDS:
            self._io(f"write {self.url_of(f'_staging/{uid}/{kind}.parquet')}",
                     lambda kind=kind: self._write_parquet(self._p("_staging", uid, f"{kind}.parquet"), tables[kind]))
        if before_commit is not None:
            before_commit()
        marker = {**marker, "unit": uid, "files": {k: self.data_rel(k, uid) for k in KINDS}}
        self._io(f"create {self.url_of('_committed')}", lambda: self.fs.makedirs(self._p("_committed"), exist_ok=True))
        self._put(f"_committed/{uid}.json", json.dumps(marker).encode())
        try:
            self.publish(uid)
        except StorageError as e:
            log.warning("unit %s is committed but not yet published (%s); the next roll-forward publishes it", uid, e)
        return marker

    def _write_parquet(self, path: str, table: pa.Table) -> None:
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with self.fs.open(path, "wb") as f:
            pq.write_table(table, f, compression=self.compression)

    def publish(self, uid: str) -> None:
        """Move a committed unit's staged files to their final names (idempotent: roll forward)."""
        for kind in KINDS:
            staged, final = self._p("_staging", uid, f"{kind}.parquet"), self._p(self.data_rel(kind, uid))
            self._io(f"publish {self.url_of(self.data_rel(kind, uid))}", lambda s=staged, f=final: self._move(s, f))
        self._io(f"clean {self.url_of(f'_staging/{uid}')}", lambda: self._rm_if_exists(self._p("_staging", uid)))

    def _move(self, staged: str, final: str) -> None:
        if self.fs.exists(staged):
            self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
            self.fs.mv(staged, final)

    def _rm_if_exists(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def roll_forward(self) -> int:
        """Publish committed units whose staged files are still there; returns how many."""
        pending = [uid for uid in self.committed()
                   if self._io("check staging", lambda uid=uid: self.fs.exists(self._p("_staging", uid)))]
        for uid in pending:
            self.publish(uid)
        return len(pending)

    # ---- end of run -------------------------------------------------------------------------
    def finalize(self, summary: dict) -> dict:
        """Manifest (totals + every committed file) then _SUCCESS, last."""
        self.roll_forward()
        self._io("clean staging", lambda: self._rm_if_exists(self._p("_staging")))   # uncommitted leftovers
        markers = self.committed()
        files = {k: sorted(self.url_of(m["files"][k]) for m in markers.values()) for k in KINDS}
        manifest = {**summary, "units": len(markers), "files": files}
        self._put("manifest.json", json.dumps(manifest, indent=2).encode())
        self._put("_SUCCESS", b"")
        return manifest

    def is_complete(self) -> bool:
        return self._io("check _SUCCESS", lambda: self.fs.exists(self._p("_SUCCESS")))

    def committed_files(self, kind: str) -> list[str]:
        """URLs of the `kind` files of committed units only: what a reader may load mid-run. A unit
        whose publish has not finished is read from _staging."""
        urls = []
        for uid, m in sorted(self.committed().items()):
            final, staged = m["files"][kind], f"_staging/{uid}/{kind}.parquet"
            exists = self._io(f"check {final}", lambda final=final: self.fs.exists(self._p(final)))
            urls.append(self.url_of(final if exists else staged))
        return urls


def _diff(old: dict, new: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) of every leaf that differs."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append((f"{prefix}{key}", a, b))
    return out
