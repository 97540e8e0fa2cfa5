"""The quality gate of a synthetic-data stage: flag, never drop.

`curate` reads a generation stage's committed completions and writes `curated/<unit>.parquet` (every
row) and `kept/<unit>.parquet` (the kept rows, what the dataset card points at): each unit's
completions rows, then

    prompt, sample      the row's rendered prompt and sample index (joined from the stage's input by id)
    is_empty            the text is empty or whitespace only
    is_truncated        finish_reason is `length` (cut by max_tokens) or `context` (the context limit)
    is_duplicate        a non-empty text exactly equal to an earlier row's, in the stage's input order
    duplicate_of        (seed, template, sample; `source_row`): that first row's id, else null
    is_near_duplicate   MinHash/LSH (near_dup.py): nearly the text of an earlier row of this slot, or of
    near_duplicate_of   the run's earlier slots (near_duplicate_slot names it; null: this slot); exact
    near_duplicate_slot duplicates and empty rows are not checked
    is_invalid          not a valid record (the template's response_format: completions' `valid` is
    invalid_reason      false) or failing the template's `validate` (python, json, regex): why
    is_kept             none of the flags

`curate_judged` writes a judge stage's tables: the rows it judged (its input's kept rows, every
column) with `judge_score_<judge>`, `judge_reason_<judge>` and `is_rejected_<judge>` (no valid
record, a score below min_score, or a choice outside accept), and `is_kept` = not rejected.

Why separate tables rather than new columns in completions/: the writer's committed files are never
rewritten in place (their commit markers, the manifest and readers mid-run rely on them), and these
are derived: the same names and content on every rerun, so a run that died while writing them writes
them again. Memory: one unit's table at a time, plus a digest and a signature per row.
"""
from __future__ import annotations

import ast
import hashlib
import io
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq

from ..io.reader import filesystem
from ..io.storage import read_parquet
from ..io.writer import RunOutput
from .config import StageConfig, TemplateConfig
from .near_dup import NearDuplicates

TRUNCATED = ("length", "context")
FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.S)
FLAG_FIELDS = [pa.field("is_empty", pa.bool_()), pa.field("is_truncated", pa.bool_()),
               pa.field("is_duplicate", pa.bool_()), pa.field("duplicate_of", pa.string()),
               pa.field("is_near_duplicate", pa.bool_()), pa.field("near_duplicate_of", pa.string()),
               pa.field("near_duplicate_slot", pa.string()),
               pa.field("is_invalid", pa.bool_()), pa.field("invalid_reason", pa.string()),
               pa.field("is_kept", pa.bool_())]
FLAGS = ("empty", "truncated", "duplicate", "near_duplicate", "invalid")


def text_key(text: str | None) -> str | None:
    """The duplicate-check key of a text: None for empty/whitespace-only texts."""
    if text is None or not text.strip():
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def validate(text: str, t: TemplateConfig | None) -> str | None:
    """Why `text` fails the template's `validate`, or None."""
    check = t.validator() if t is not None else None
    if check is None:
        return None
    kind, pattern = check
    if kind == "regex":
        return None if re.search(pattern, text) else f"does not match the regex {pattern!r}"
    if kind == "json":
        try:
            json.loads(text)
            return None
        except json.JSONDecodeError as e:
            return f"not JSON: {e}"
    blocks = FENCE.findall(text)
    if not blocks:
        return "no complete fenced code block (```...```)"
    for i, block in enumerate(blocks):
        try:
            ast.parse(block)
        except SyntaxError as e:
            return f"code block {i + 1} does not parse: line {e.lineno}: {e.msg}"
    return None


def row_check(r: dict, t: TemplateConfig | None) -> dict:
    """The per-row part of the flags, for a row {id, source_row, finish_reason, text[, valid]}."""
    key = text_key(r["text"])
    reason = "not a valid record for the template's response_format" if r.get("valid") is False else None
    if reason is None and key is not None:
        reason = validate(r["text"], t)
    return {"id": r["id"], "source_row": r["source_row"], "key": key, "finish_reason": r["finish_reason"],
            "invalid_reason": reason}


def add_signatures(checked: list[dict], texts: list[str | None], near: NearDuplicates) -> None:
    """Each row_check row's MinHash `signature` from its text (None where the text is empty: not checked)."""
    sigs = iter(near.signatures([t for c, t in zip(checked, texts) if c["key"] is not None]))
    for c in checked:
        c["signature"] = next(sigs) if c["key"] is not None else None


def quality_flags(rows: list[dict], near: NearDuplicates | None = None) -> dict[str, dict]:
    """id -> flags, for row_check rows of one stage (plus `signature` where near-duplicates are on)."""
    first: dict[str, str] = {}
    ordered = sorted(rows, key=lambda r: (r["source_row"], r["id"]))
    exact = {}
    for r in ordered:
        dup_of = first.setdefault(r["key"], r["id"]) if r["key"] is not None else None
        exact[r["id"]] = None if dup_of == r["id"] else dup_of
    nearest = near.check([{"id": r["id"], "signature": r.get("signature") if r["key"] is not None
                           and exact[r["id"]] is None else None} for r in ordered]) if near else {}
    out = {}
    for r in ordered:
        slot, near_of = nearest.get(r["id"]) or (None, None)
        flags = {"is_empty": r["key"] is None, "is_truncated": r["finish_reason"] in TRUNCATED,
                 "is_duplicate": exact[r["id"]] is not None, "duplicate_of": exact[r["id"]],
                 "is_near_duplicate": near_of is not None, "near_duplicate_of": near_of, "near_duplicate_slot": slot,
                 "is_invalid": r["invalid_reason"] is not None, "invalid_reason": r["invalid_reason"]}
        flags["is_kept"] = not any(flags[f"is_{f}"] for f in FLAGS)
        out[r["id"]] = flags
    return out


def count(flags: dict[str, dict]) -> dict:
    values = list(flags.values())
    return {"checked": len(values), **{f: sum(v[f"is_{f}"] for v in values) for f in FLAGS},
            "kept": sum(v["is_kept"] for v in values)}


def _read(url: str, storage, columns=None) -> pa.Table:
    fs, path = filesystem(url, storage)
    return read_parquet(fs, path, columns)


def _write(folder, rel: str, table: pa.Table, compression: str) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression=compression)
    folder.put(rel, buf.getvalue())


def _write_tables(folder, uid: str, table: pa.Table, compression: str) -> None:
    """curated/<unit> (every row) and kept/<unit> (the kept ones; none where no row is kept: `datasets`
    cannot read a Parquet file without rows)."""
    _write(folder, f"curated/{uid}.parquet", table, compression)
    kept = table.filter(table.column("is_kept"))
    if kept.num_rows:
        _write(folder, f"kept/{uid}.parquet", kept, compression)


def curate(run: RunOutput, folder, input_url: str, storage, stage: StageConfig,
           near: NearDuplicates | None) -> dict:
    """Write curated/ and kept/ under `folder` (a job.SlotFolder) for every committed unit of `run`,
    and near_duplicates.parquet (the signatures) where `near` is given; returns the counts."""
    templates = {t.id: t for t in stage.templates}
    files = dict(zip(sorted(run.committed()), run.committed_files("completions")))
    checked = []
    for url in files.values():
        rows = _read(url, storage, ["id", "source_row", "finish_reason", "text", "valid", "template"]).to_pylist()
        part = [row_check(r, templates.get(r["template"])) for r in rows]
        if near is not None:
            add_signatures(part, [r["text"] for r in rows], near)
        checked += part
    flags = quality_flags(checked, near)
    inputs = {r["id"]: r for r in _read(input_url, storage, ["id", "prompt", "sample"]).to_pylist()}
    for uid, url in files.items():
        table = _read(url, storage)
        ids = table.column("id").to_pylist()
        table = table.append_column("prompt", pa.array([inputs[i]["prompt"] for i in ids], pa.string()))
        table = table.append_column("sample", pa.array([inputs[i]["sample"] for i in ids], pa.int64()))
        for f in FLAG_FIELDS:
            table = table.append_column(f, pa.array([flags[i][f.name] for i in ids], f.type))
        _write_tables(folder, uid, table, run.compression)
    if near is not None:
        _write(folder, "near_duplicates.parquet", near.table(), run.compression)
    return count(flags)


def judgment(stage: StageConfig, record: str | None) -> tuple[object, str | None, bool]:
    """(score, reason, rejected) of one judge answer (its record: compact JSON when valid, else None)."""
    if record is None:
        return None, None, True
    answer = json.loads(record)
    score, reason = answer.get("score"), answer.get("reason")
    if stage.is_choice():
        return score, reason, stage.accept is not None and score not in stage.accept
    return float(score), reason, stage.min_score is not None and score < stage.min_score


def judged_row(stage: StageConfig, row: dict, answer: dict) -> tuple[dict, object, bool]:
    """A judged row with the judge's columns, its score and whether it is rejected; `answer`: the
    judge's completion {record, valid}."""
    score, reason, rejected = judgment(stage, answer["record"] if answer["valid"] else None)
    return ({**row, f"judge_score_{stage.id}": score, f"judge_reason_{stage.id}": reason,
             f"is_rejected_{stage.id}": rejected, "is_kept": not rejected}, score, rejected)


def judge_fields(stage: StageConfig) -> list[pa.Field]:
    score = pa.string() if stage.is_choice() else pa.float64()
    return [pa.field(f"judge_score_{stage.id}", score), pa.field(f"judge_reason_{stage.id}", pa.string()),
            pa.field(f"is_rejected_{stage.id}", pa.bool_())]


def curate_judged(run: RunOutput, folder, storage, stage: StageConfig, judged: dict[str, dict],
                  schema: pa.Schema) -> dict:
    """Write curated/ and kept/ of a judge stage: the judged rows (`judged`: its input's kept rows by
    id, with `schema`) with the judge's columns, one file per unit of the judge's run."""
    fields = judge_fields(stage)
    base = pa.schema([f for f in schema if f.name not in {g.name for g in fields}])
    out_schema = pa.schema([*base, *fields])
    counts = {"judged": 0, "rejected": 0, "kept": 0}
    scores = []
    files = dict(zip(sorted(run.committed()), run.committed_files("completions")))
    for uid, url in files.items():
        rows = []
        for j in _read(url, storage, ["parent_id", "record", "valid"]).to_pylist():
            row, score, rejected = judged_row(stage, judged[j["parent_id"]], j)
            rows.append(row)
            counts["judged"] += 1
            counts["rejected"] += rejected
            scores += [score] if isinstance(score, float) else []
        _write_tables(folder, uid, pa.Table.from_pylist(rows, schema=out_schema), run.compression)
    counts["kept"] = counts["judged"] - counts["rejected"]
    counts["mean_score"] = round(sum(scores) / len(scores), 3) if scores else None
    return counts
