"""A run's output on any fsspec filesystem: unit files, commit markers, plan, manifest.

Layout under <output.path>/<run_id>/ (names depend only on run id and unit id, never on an attempt):

    config.yaml, _plan.json             resolved config (credentials redacted) and the unit plan
    _staging/<unit>/<kind>.parquet      a unit's data while it is being written (invisible)
    _committed/<unit>.json              the commit marker: the single write that makes a unit exist
    completions|rounds|errors/<unit>.parquet   published data of committed units
    manifest.json, _SUCCESS             written last, with totals and every file

Commit protocol: (1) write the three files to _staging, (2) write the marker (one object PUT:
atomic on local disks and object stores), (3) publish = move staging files to their final names.
A crash before (2) leaves only staging files, which readers never list (names starting with "_" are
skipped by pyarrow, pandas and `datasets`) and the retry overwrites; a crash between (2) and (3) is
rolled forward by the next run or the finalizer. So published folders only ever hold committed
units, each exactly once.

Knows nothing about models or Ray.
"""
from __future__ import annotations

import json
import posixpath
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from ..config import StorageConfig
from .reader import Unit, filesystem
from .schema import TABLES

KINDS = tuple(TABLES)


class OutputError(RuntimeError):
    """The output folder holds a different run, or a marker is inconsistent."""


class RunOutput:
    def __init__(self, root: str, run_id: str, storage: StorageConfig, compression: str = "zstd"):
        self.url = f"{root.rstrip('/')}/{run_id}"
        self.fs, self.path = filesystem(self.url, storage)
        self.compression = None if compression == "none" else compression
        self._protocol = self.url.split("://")[0] + "://" if "://" in self.url else ""

    # ---- paths ------------------------------------------------------------------------------
    def _p(self, *parts: str) -> str:
        return posixpath.join(self.path, *parts)

    def url_of(self, rel: str) -> str:
        return f"{self._protocol}{self._p(rel)}" if self._protocol else self._p(rel)

    @staticmethod
    def data_rel(kind: str, uid: str) -> str:
        return f"{kind}/{uid}.parquet"

    # ---- plan -------------------------------------------------------------------------------
    def prepare(self, units: list[Unit], chash: str, config_tree: dict, resume: bool) -> None:
        """Record the plan on a new run; on an existing one, check it is the same job."""
        plan = {"config_hash": chash, "units": [u.uid for u in units]}
        if self.fs.exists(self._p("_plan.json")):
            if not resume:
                raise OutputError(f"{self.url} already holds a run; use a new run.run_id or run.resume=true")
            with self.fs.open(self._p("_plan.json")) as f:
                old = json.load(f)
            if old["config_hash"] != chash:
                raise OutputError(f"{self.url} holds run {old['config_hash']} with another config "
                                  f"(this one: {chash}); use a new run.run_id")
            if old["units"] != plan["units"]:
                raise OutputError(f"{self.url}: the input now plans different units than the "
                                  f"recorded run; use a new run.run_id")
            return
        self.fs.makedirs(self.path, exist_ok=True)
        self._put("config.yaml", yaml.safe_dump(config_tree, sort_keys=False).encode())
        self._put("_plan.json", json.dumps(plan).encode())

    def _put(self, rel: str, data: bytes) -> None:
        with self.fs.open(self._p(rel), "wb") as f:
            f.write(data)

    # ---- units ------------------------------------------------------------------------------
    def committed(self) -> dict[str, dict]:
        """uid -> marker of every committed unit."""
        out = {}
        for m in self.fs.glob(self._p("_committed", "*.json")):
            with self.fs.open(m) as f:
                marker = json.load(f)
            out[marker["unit"]] = marker
        return out

    def write_unit(self, uid: str, tables: dict[str, pa.Table], marker: dict,
                   before_commit: Callable[[], None] | None = None) -> dict:
        """Stage, commit, publish. Returns the marker written."""
        for kind in KINDS:
            self.fs.makedirs(self._p("_staging", uid), exist_ok=True)
            with self.fs.open(self._p("_staging", uid, f"{kind}.parquet"), "wb") as f:
                pq.write_table(tables[kind], f, compression=self.compression)
        if before_commit is not None:
            before_commit()
        marker = {**marker, "unit": uid, "files": {k: self.data_rel(k, uid) for k in KINDS}}
        self.fs.makedirs(self._p("_committed"), exist_ok=True)
        self._put(f"_committed/{uid}.json", json.dumps(marker).encode())
        self.publish(uid)
        return marker

    def publish(self, uid: str) -> None:
        """Move a committed unit's staged files to their final names (idempotent: roll forward)."""
        for kind in KINDS:
            staged = self._p("_staging", uid, f"{kind}.parquet")
            if self.fs.exists(staged):
                self.fs.makedirs(self._p(kind), exist_ok=True)
                self.fs.mv(staged, self._p(self.data_rel(kind, uid)))
        if self.fs.exists(self._p("_staging", uid)):
            self.fs.rm(self._p("_staging", uid), recursive=True)

    def roll_forward(self) -> int:
        """Publish committed units whose staged files are still there; returns how many."""
        pending = [uid for uid in self.committed()
                   if self.fs.exists(self._p("_staging", uid))]
        for uid in pending:
            self.publish(uid)
        return len(pending)

    # ---- end of run -------------------------------------------------------------------------
    def finalize(self, summary: dict) -> dict:
        """Manifest (totals + every committed file) then _SUCCESS, last."""
        self.roll_forward()
        if self.fs.exists(self._p("_staging")):
            self.fs.rm(self._p("_staging"), recursive=True)     # uncommitted leftovers of retried attempts
        markers = self.committed()
        files = {k: sorted(self.url_of(m["files"][k]) for m in markers.values()) for k in KINDS}
        manifest = {**summary, "units": len(markers), "files": files}
        self._put("manifest.json", json.dumps(manifest, indent=2).encode())
        self._put("_SUCCESS", b"")
        return manifest

    def is_complete(self) -> bool:
        return self.fs.exists(self._p("_SUCCESS"))

    def committed_files(self, kind: str) -> list[str]:
        """URLs of the `kind` files of committed units only: what a reader may load mid-run."""
        return sorted(self.url_of(m["files"][kind]) for m in self.committed().values())
