"""Discover input shards, plan work units, stream a unit's rows.

A work unit is (file, row range) of at most `rows_per_unit` rows, so one huge file becomes many
units. Planning reads only metadata (Parquet footers) or streams the file once (JSONL, Arrow
streams) and, optionally, the id column to find duplicate ids; a unit's rows are then read one
record batch at a time, so a worker never holds a whole file.

Knows nothing about models, tokenizers or Ray.
"""
from __future__ import annotations

import bisect
import hashlib
import io
import itertools
import json
import posixpath
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ConfigError, one_of
from .schema import TABLES
from .storage import StorageConfig, arrow_input

INPUT_FORMATS = ("auto", "parquet", "jsonl", "arrow")


@dataclass
class InputConfig:
    path: str = "data/demo"                 # file, folder or glob on any fsspec URL (local, s3://, memory://)
    format: str = "auto"                    # auto (from the extension) | parquet | jsonl | arrow
                                            # (a `datasets` save_to_disk folder is found automatically)
    prompt_column: str = "prompt"           # a plain string prompt (chat template applied)
    messages_column: str = "messages"       # or a chat: list of {role, content}
    id_column: str = "id"                   # optional; else a stable id from file + row index
    response_format_column: str = "response_format"   # optional per-row constraint (a JSON object or its
                                            # text); overrides sampling.response_format for that row
    rows_per_unit: int = 256                # a work unit is (file, row range) of at most this many rows
    check_duplicate_ids: bool = True        # plan-time pass over the id column (memory ~ number of ids)
    limit: Optional[int] = None             # plan at most this many rows in total
    passthrough_columns: list[str] = field(default_factory=list)   # input columns copied into every
                                            # completions/rounds/errors row (as strings; JSON for
                                            # non-strings); each must exist in every shard

    def __post_init__(self):
        one_of("input.format", self.format, INPUT_FORMATS)
        _check_passthrough(self.passthrough_columns)
        if self.rows_per_unit < 1:
            raise ConfigError(f"input.rows_per_unit: expected >= 1, got {self.rows_per_unit}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"input.limit: expected >= 1 or null, got {self.limit}")
        if not self.path:
            raise ConfigError("input.path: required")


def _check_passthrough(names: list[str]) -> None:
    reserved = {n for schema in TABLES.values() for n in schema.names}
    bad = [n for n in names if not n or n in reserved]
    if bad or len(set(names)) != len(names):
        raise ConfigError(f"input.passthrough_columns: expected distinct names that are not output columns "
                          f"({sorted(reserved)}), got {list(names)}")

READ_BATCH_ROWS = 64


class InputError(ValueError):
    """The input cannot be read as configured: names the path and the reason."""


@dataclass(frozen=True)
class Unit:
    uid: str                         # stable: depends on the file's relative path and the row range
    file: str                        # full URL of the shard
    rel: str                         # path relative to the input root (part of default row ids)
    fmt: str                         # parquet | jsonl | arrow
    start: int                       # first row (0-based, within the file)
    stop: int                        # one past the last row
    duplicate_rows: tuple[int, ...] = field(default=())   # rows whose id appeared earlier in the plan

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


def storage_options(url: str, storage: StorageConfig) -> dict:
    """fsspec options for a URL: s3 endpoint/credentials from config, else the AWS environment.

    s3fs's listing cache is off: the run folder is written concurrently by other processes (the
    workers, earlier or later runs), and fsspec shares one filesystem instance per option set across
    a process, so a cached listing (e.g. `_committed/` taken before the workers started) would hide
    their markers from the driver's manifest and resume logic."""
    if not url.startswith(("s3://", "s3a://")):
        return {}
    opts, client = {"use_listings_cache": False}, {}
    if storage.key is not None:
        opts["key"] = storage.key
    if storage.secret is not None:
        opts["secret"] = storage.secret
    if storage.endpoint_url is not None:
        client["endpoint_url"] = storage.endpoint_url
    if storage.region is not None:
        client["region_name"] = storage.region
    if client:
        opts["client_kwargs"] = client
    return opts


def filesystem(url: str, storage: StorageConfig):
    """(fs, path without protocol) for a URL."""
    return fsspec.core.url_to_fs(url, **storage_options(url, storage))


def _format_of(path: str, configured: str) -> str | None:
    if configured != "auto":
        return configured
    for ext, fmt in ((".parquet", "parquet"), (".jsonl", "jsonl"), (".json", "jsonl"), (".arrow", "arrow")):
        if path.endswith(ext):
            return fmt
    return None


def discover(cfg: InputConfig, storage: StorageConfig) -> list[tuple[str, str, str]]:
    """(url, relative path, format) of every input shard, sorted. A folder means every supported file
    under it; a `datasets` save_to_disk folder means its Arrow files (from state.json)."""
    fs, root = filesystem(cfg.path, storage)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    try:
        if fs.isdir(root):
            if fs.exists(posixpath.join(root, "state.json")):
                with fs.open(posixpath.join(root, "state.json")) as f:
                    names = [d["filename"] for d in json.load(f)["_data_files"]]
                paths = [posixpath.join(root, n) for n in names]
                base, fixed = root, "arrow"
            else:
                paths, base, fixed = fs.find(root), root, None
        elif any(c in root for c in "*?["):
            paths, base, fixed = fs.glob(root), _glob_base(root), None
        elif fs.isfile(root):
            paths, base, fixed = [root], posixpath.dirname(root), None
        else:
            raise InputError(f"input.path {cfg.path!r}: no such file or folder")
    except OSError as e:
        raise InputError(f"input.path {cfg.path!r}: cannot list: {e}") from None
    shards = []
    for p in sorted(paths):
        fmt = fixed or _format_of(p, cfg.format)
        rel = posixpath.relpath(p, base) if base and p != base else posixpath.basename(p)
        if fmt is None or is_hidden(rel):
            continue
        url = p if protocol in ("file", "local") else f"{protocol}://{p}"
        shards.append((url, rel, fmt))
    if not shards:
        raise InputError(f"input.path {cfg.path!r}: no Parquet/JSONL/Arrow files found")
    return shards


def is_hidden(rel: str) -> bool:
    """Paths with any component starting with "_" or "." are not data (_staging, _committed,
    .cache, _SUCCESS...): the convention of Spark, pyarrow and `datasets`."""
    return any(part.startswith(("_", ".")) for part in rel.split("/"))


def check_output_outside_input(cfg: InputConfig, output_url: str, storage: StorageConfig) -> None:
    """Refuse an output folder inside an input folder: a later run would plan its own output."""
    in_fs, in_path = filesystem(cfg.path, storage)
    out_fs, out_path = filesystem(output_url, storage)
    if type(in_fs) is not type(out_fs):
        return
    if any(c in in_path for c in "*?["):
        root = _glob_base(in_path)
    elif in_fs.isdir(in_path):
        root = in_path
    else:
        return                                  # a single input file has nothing under it
    root, out_path = root.rstrip("/"), out_path.rstrip("/")
    if out_path == root or out_path.startswith(root + "/"):
        raise InputError(f"output.path {output_url!r} lies inside input.path {cfg.path!r}: a later run "
                         f"would read its own output as input; choose an output folder outside the input")


def _glob_base(pattern: str) -> str:
    """The folder part of a glob before its first wildcard."""
    head = pattern.split("*")[0].split("?")[0].split("[")[0]
    return posixpath.dirname(head)


def _columns_and_rows(url: str, fmt: str, storage: StorageConfig) -> tuple[list[str], int]:
    fs, path = filesystem(url, storage)
    with arrow_input(fs, path) as (f, threaded):
        if fmt == "parquet":
            meta = pq.ParquetFile(f, pre_buffer=threaded).metadata
            return meta.schema.to_arrow_schema().names, meta.num_rows
        if fmt == "arrow":
            reader = _arrow_reader(f)
            return reader.schema.names, sum(b.num_rows for b in reader)
        columns, rows = None, 0
        for line in io.TextIOWrapper(f, encoding="utf-8"):
            if line.strip():
                if columns is None:
                    first = json.loads(line)
                    if not isinstance(first, dict):
                        raise ValueError("first JSONL line is not an object")
                    columns = list(first)
                rows += 1
        return columns or [], rows


def _arrow_reader(f):
    """Arrow IPC stream (what `datasets` writes) or file format."""
    head = f.read(6)
    f.seek(0)
    return pa.ipc.open_file(f) if head == b"ARROW1" else pa.ipc.open_stream(f)


def _unit_id(rel: str, start: int, stop: int) -> str:
    digest = hashlib.sha256(rel.encode()).hexdigest()[:10]
    return f"{digest}-{start:09d}-{stop:09d}"


def plan_units(cfg: InputConfig, storage: StorageConfig) -> list[Unit]:
    """Every shard's schema is checked (a prompt or messages column must exist) and split into units.
    Fails fast with the path and the reason for a missing column or an unreadable file."""
    units, budget = [], cfg.limit
    for url, rel, fmt in discover(cfg, storage):
        try:
            columns, num_rows = _columns_and_rows(url, fmt, storage)
        except Exception as e:  # noqa: BLE001 -- any reader failure is reported with its path
            raise InputError(f"{url}: unreadable as {fmt}: {type(e).__name__}: {e}") from None
        if cfg.prompt_column not in columns and cfg.messages_column not in columns:
            raise InputError(f"{url}: needs a {cfg.prompt_column!r} or {cfg.messages_column!r} column "
                             f"(input.prompt_column / input.messages_column); found {columns}")
        missing = [c for c in cfg.passthrough_columns if c not in columns]
        if missing:
            raise InputError(f"{url}: input.passthrough_columns {missing} not found; found {columns}")
        if budget is not None:
            num_rows, budget = min(num_rows, budget), budget - min(num_rows, budget)
        for start in range(0, num_rows, cfg.rows_per_unit):
            stop = min(start + cfg.rows_per_unit, num_rows)
            units.append(Unit(_unit_id(rel, start, stop), url, rel, fmt, start, stop))
        if budget == 0:
            break
    if cfg.check_duplicate_ids:
        units = _mark_duplicates(units, cfg, storage)
    return units


def _mark_duplicates(units: list[Unit], cfg: InputConfig, storage: StorageConfig) -> list[Unit]:
    """The first occurrence of an id (in plan order) runs; later rows with the same id become
    `duplicate_id` errors. Reads only the id column, once per file."""
    seen: set[str] = set()
    dups: dict[str, list[int]] = {}
    for _, group in itertools.groupby(units, key=lambda u: u.file):
        group = list(group)
        span = replace(group[0], uid="", stop=group[-1].stop)      # the file's planned rows
        stops = [u.stop for u in group]
        for index, rid in _ids(span, cfg.id_column, storage):
            if rid is None:
                continue
            if str(rid) in seen:
                dups.setdefault(group[bisect.bisect_right(stops, index)].uid, []).append(index)
            seen.add(str(rid))
    return [replace(u, duplicate_rows=tuple(dups[u.uid])) if u.uid in dups else u for u in units]


def _ids(span: Unit, column: str, storage: StorageConfig) -> Iterator[tuple[int, object]]:
    """(row index, id or None) over a row range, reading one column as Arrow arrays."""
    fs, path = filesystem(span.file, storage)
    with arrow_input(fs, path) as (f, threaded):
        if span.fmt == "jsonl":
            for index, row in _jsonl_rows(f, span, [column]):
                yield index, row.get(column)
            return
        for offset, batch in _batches(f, threaded, span, [column]):
            if column not in batch.schema.names:
                return
            yield from enumerate(batch.column(column).to_pylist(), start=offset)


def iter_rows(unit: Unit, storage: StorageConfig, columns: list[str] | None = None
              ) -> Iterator[tuple[int, dict]]:
    """(row index in the file, row dict) for the unit's rows, one record batch at a time. Columns
    not present in the file are skipped."""
    fs, path = filesystem(unit.file, storage)
    with arrow_input(fs, path) as (f, threaded):
        if unit.fmt == "jsonl":
            yield from _jsonl_rows(f, unit, columns)
            return
        for offset, batch in _batches(f, threaded, unit, columns):
            for i, row in enumerate(batch.to_pylist()):
                yield offset + i, row


def _batches(f, threaded: bool, unit: Unit, columns) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Record batches covering [start, stop), sliced to the range, with their first row index;
    `threaded` as storage.arrow_input says."""
    if unit.fmt == "parquet":
        pf = pq.ParquetFile(f, pre_buffer=threaded)
        names = pf.schema_arrow.names
        cols = [c for c in columns if c in names] if columns is not None else None
        sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        row_groups = [g for g in range(len(sizes))     # only row groups overlapping the range
                      if starts[g] < unit.stop and starts[g] + sizes[g] > unit.start]
        offset = starts[row_groups[0]] if row_groups else unit.stop
        source = pf.iter_batches(batch_size=READ_BATCH_ROWS, row_groups=row_groups, columns=cols,
                                 use_threads=threaded)
    else:
        reader = _arrow_reader(f)
        names = reader.schema.names
        cols = [c for c in columns if c in names] if columns is not None else None
        offset, source = 0, (b.select(cols) if cols is not None else b for b in reader)
    for batch in source:
        lo, hi = max(unit.start - offset, 0), min(unit.stop - offset, batch.num_rows)
        if hi > lo:
            yield offset + lo, batch.slice(lo, hi - lo)
        offset += batch.num_rows
        if offset >= unit.stop:
            return


def _jsonl_rows(f, unit: Unit, columns) -> Iterator[tuple[int, dict]]:
    index = 0
    for line in io.TextIOWrapper(f, encoding="utf-8"):
        if not line.strip():
            continue
        if unit.start <= index < unit.stop:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row = {"__error__": f"invalid JSON: {e}"}
            if not isinstance(row, dict):
                row = {"__error__": f"expected a JSON object, got {type(row).__name__}"}
            yield index, row if columns is None else {k: row.get(k) for k in columns}
        index += 1
        if index >= unit.stop:
            return
