"""The quality gate of a synthetic-data slot: flag, never drop.

`curate` reads the slot's committed completions and writes `<slot>/curated/<unit>.parquet`: each
unit's completions rows, then

    prompt, sample   the row's rendered prompt and sample index (joined from the slot's input by id)
    is_empty         the text is empty or whitespace only
    is_truncated     finish_reason is `length` (cut by max_tokens) or `context` (cut by the context limit)
    is_duplicate     a non-empty text exactly equal to an earlier row's, in the slot's input order
                     (seed, template, sample; `source_row`): the first occurrence is not a duplicate
    duplicate_of     that first row's id (null otherwise)
    is_invalid       the template declared a response_format and the row is not a valid record
                     (completions' `valid` is false: cut by max_tokens, or not parsing/validating)
    is_kept          none of the four flags

and returns the counts for the slot's summary. Input rows that could not run are in the run's
errors table (with their slot), not here.

Why a separate table rather than new columns in completions/: the writer's committed files are
never rewritten in place (their commit markers, the manifest and readers mid-run rely on them), and
curated/ is derived: the same names and content on every rerun, so a run that died while writing
it simply writes it again. Users read one glob (`slot=*/curated/*.parquet`) and filter on the
flags. Memory: one unit's table at a time, plus a 32-byte digest per row for the duplicate check.

Knows the run's output layout; knows nothing about models, Ray or the schedule.
"""
from __future__ import annotations

import hashlib
import io

import pyarrow as pa
import pyarrow.parquet as pq

from ..io.reader import filesystem
from ..io.storage import read_parquet
from ..io.writer import RunOutput

TRUNCATED = ("length", "context")
FLAG_FIELDS = [pa.field("is_empty", pa.bool_()), pa.field("is_truncated", pa.bool_()),
               pa.field("is_duplicate", pa.bool_()), pa.field("duplicate_of", pa.string()),
               pa.field("is_invalid", pa.bool_()), pa.field("is_kept", pa.bool_())]


def text_key(text: str | None) -> str | None:
    """The duplicate-check key of a text: None for empty/whitespace-only texts."""
    if text is None or not text.strip():
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def quality_flags(rows: list[dict]) -> dict[str, dict]:
    """id -> flags, for rows {id, source_row, finish_reason, key (text_key)[, valid]} of one slot."""
    first: dict[str, str] = {}
    out = {}
    for r in sorted(rows, key=lambda r: (r["source_row"], r["id"])):
        dup_of = None
        if r["key"] is not None:
            dup_of = first.setdefault(r["key"], r["id"])
            dup_of = None if dup_of == r["id"] else dup_of
        flags = {"is_empty": r["key"] is None, "is_truncated": r["finish_reason"] in TRUNCATED,
                 "is_duplicate": dup_of is not None, "duplicate_of": dup_of, "is_invalid": r.get("valid") is False}
        flags["is_kept"] = not (flags["is_empty"] or flags["is_truncated"] or flags["is_duplicate"]
                                or flags["is_invalid"])
        out[r["id"]] = flags
    return out


def count(flags: dict[str, dict]) -> dict:
    values = list(flags.values())
    return {"checked": len(values), "empty": sum(f["is_empty"] for f in values),
            "truncated": sum(f["is_truncated"] for f in values),
            "duplicate": sum(f["is_duplicate"] for f in values), "invalid": sum(f["is_invalid"] for f in values),
            "kept": sum(f["is_kept"] for f in values)}


def _read(url: str, storage, columns=None) -> pa.Table:
    fs, path = filesystem(url, storage)
    return read_parquet(fs, path, columns)


def curate(run: RunOutput, folder, input_url: str, storage) -> dict:
    """Write curated/<unit>.parquet under `folder` (a synthetic.SlotFolder) for every committed
    unit of `run`; returns the counts."""
    units = sorted(run.committed())
    files = dict(zip(units, run.committed_files("completions")))
    keys = []
    for url in files.values():
        t = _read(url, storage, ["id", "source_row", "finish_reason", "text", "valid"])
        keys += [{**r, "key": text_key(r.pop("text"))} for r in t.to_pylist()]
    flags = quality_flags(keys)
    inputs = {r["id"]: r for r in _read(input_url, storage, ["id", "prompt", "sample"]).to_pylist()}
    folder.io("create curated/ in", lambda: folder.fs.makedirs(folder.p("curated"), exist_ok=True))
    for uid, url in files.items():
        table = _read(url, storage)
        ids = table.column("id").to_pylist()
        table = table.append_column("prompt", pa.array([inputs[i]["prompt"] for i in ids], pa.string()))
        table = table.append_column("sample", pa.array([inputs[i]["sample"] for i in ids], pa.int64()))
        for f in FLAG_FIELDS:
            table = table.append_column(f, pa.array([flags[i][f.name] for i in ids], f.type))
        buf = io.BytesIO()
        pq.write_table(table, buf, compression=run.compression)
        folder.put(f"curated/{uid}.parquet", buf.getvalue())
    return count(flags)
