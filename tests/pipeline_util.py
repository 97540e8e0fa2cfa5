"""Helpers shared by the pipeline tests: prompt shards, job configs, reading a run back."""
from __future__ import annotations

import collections

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.job.config import load_config
from pipeline.io.schema import to_table

WORDS = ("river stone cloud lamp garden violin harbor pencil meadow rocket copper lantern orbit "
         "maple canyon ember falcon quartz willow saffron").split()


def prompt_rows(n: int, prefix: str, seed: int = 0) -> list[dict]:
    """n real-text prompts of varied length with unique ids `<prefix>-<i>`."""
    rows = []
    for i in range(n):
        k = 3 + (i * 7 + seed) % 17
        words = [WORDS[(i * 31 + j * 7 + seed) % len(WORDS)] for j in range(k)]
        rows.append({"id": f"{prefix}-{i}", "prompt": "Continue: " + " ".join(words)})
    return rows


def write_parquet(path: Path, rows: list[dict], row_group_size: int = 8) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def job_config(model_dir: Path, input_path: str, output_path: str, *overrides: str):
    """A small, fast job on the tiny model: greedy, n-gram drafts, short outputs."""
    return load_config(None, job_overrides(model_dir, input_path, output_path, *overrides))


def job_overrides(model_dir: Path, input_path: str, output_path: str, *overrides: str) -> list[str]:
    """job_config's settings as `key=value` overrides (for `python jobs/generate.py ...`)."""
    # draft_dtype same: a test that makes the target its own draft expects every draft accepted, which
    # holds only with the draft in the target's dtype (auto would pick bf16 on a CPU with bf16). Fixed-length
    # drafts: the adaptive default drafts where this machine's measured costs say it pays, so whether a
    # small job drafts at all would depend on the machine's load while it calibrates
    base = [f"models.target={model_dir}", "drafting.method=ngram", "drafting.adaptive=false", "models.dtype=float32",
            "models.draft_dtype=same",
            "engine.max_num_seqs=4", "engine.max_model_len=256", "drafting.num_speculative_tokens=3",
            "sampling.max_tokens=8", "sampling.temperature=0", f"input.path={input_path}",
            "input.rows_per_unit=5", f"output.path={output_path}", "run.run_id=t", "run.progress=false",
            "cluster.num_workers=2", "cluster.num_cpus_per_worker=1"]
    return base + list(overrides)


def read_run(run_dir: Path) -> dict[str, list[dict]]:
    """Every published table of a run, as rows."""
    out = {}
    for kind in ("completions", "rounds", "errors"):
        files = sorted((run_dir / kind).glob("*.parquet"))
        out[kind] = [r for f in files for r in pq.read_table(f).to_pylist()]
    return out


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def shards(root, files=3, rows=7):
    ids = []
    for f in range(files):
        rows_f = prompt_rows(rows + f, f"f{f}", seed=f)
        write_parquet(root / f"part-{f}.parquet", rows_f, row_group_size=4)
        ids += [r["id"] for r in rows_f]
    return ids


def check_exactly_once(run, ids):
    got = [c["id"] for c in run["completions"]] + [e["id"] for e in run["errors"]]
    assert sorted(got) == sorted(ids), "every input row in exactly one of completions or errors"
    emitted = collections.Counter()
    for r in run["rounds"]:
        emitted[r["id"]] += r["emitted"]
    for c in run["completions"]:
        assert emitted[c["id"]] == c["completion_tokens"] == len(c["token_ids"])
        assert c["rounds"] == sum(1 for r in run["rounds"] if r["id"] == c["id"])


def unit_tables(n):
    comp = [{k: None for k in to_table("completions", []).schema.names} | {"id": str(i)} for i in range(n)]
    return {"completions": to_table("completions", comp), "rounds": to_table("rounds", []),
            "errors": to_table("errors", [])}

