"""Run one engine in this process over a prompt file: the single-process path behind jobs/generate.py
until the Ray driver lands. Reads rows, turns bad ones into error records, shows progress, writes
completions / rounds / errors as Parquet, prints a summary.

This module knows nothing about Ray; it is the engine's first user, not part of it.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from .config import JobConfig, config_hash
from .engine import RequestError
from .runtime import build_engine, prompt_ids

ROW_OVERRIDES = ("max_tokens", "temperature", "top_p", "top_k", "stop")


def read_rows(cfg: JobConfig) -> list[dict]:
    path = cfg.input.path
    with fsspec.open(path, "rb") as f:
        if path.endswith(".parquet"):
            rows = pq.read_table(f).to_pylist()
        else:
            rows = [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
    return rows[:cfg.input.limit] if cfg.input.limit else rows


def _request(row: dict, index: int, cfg: JobConfig, tokenizer):
    """(id, token ids, params, seed) for a row; raises RequestError naming the field."""
    rid = str(row.get(cfg.input.id_column, index))
    prompt, messages = row.get(cfg.input.prompt_column), row.get(cfg.input.messages_column)
    if messages is None and not (isinstance(prompt, str) and prompt.strip()):
        raise RequestError(cfg.input.prompt_column, f"expected a non-empty string, got {prompt!r}")
    overrides = {k: row[k] for k in ROW_OVERRIDES if row.get(k) is not None}
    if "stop" in overrides:
        overrides["stop"] = list(overrides["stop"]) if not isinstance(overrides["stop"], str) else [overrides["stop"]]
    params = cfg.sampling.to_params(**overrides)
    seed = int(row["seed"]) if row.get("seed") is not None else cfg.run.seed
    return rid, prompt_ids(tokenizer, prompt, messages), params, seed


def run_local(cfg: JobConfig) -> dict:
    t_load = time.perf_counter()
    loaded = build_engine(cfg.models, cfg.engine)
    engine, tok = loaded.engine, loaded.tokenizer
    load_s = time.perf_counter() - t_load
    rows = read_rows(cfg)
    errors = []
    for i, row in enumerate(rows):
        try:
            engine.add_request(*_request(row, i, cfg, tok))
        except (RequestError, ValueError) as e:
            errors.append({"id": str(row.get(cfg.input.id_column, i)), "reason": "bad_request",
                           "field": getattr(e, "field", None), "message": str(e)})
    completions, rounds = [], []
    t0 = time.perf_counter()
    bar = tqdm(total=len(rows) - len(errors), unit="row", disable=not cfg.run.progress)
    new_tokens = drafted = accepted = 0
    while engine.has_unfinished():
        out = engine.step()
        rounds.extend(out.rounds)
        completions.extend(out.finished)
        new_tokens += sum(r.emitted for r in out.rounds)
        drafted += sum(r.draft_len for r in out.rounds)
        accepted += sum(r.accepted for r in out.rounds)
        bar.update(len(out.finished))
        elapsed = time.perf_counter() - t0
        bar.set_postfix(tok_s=f"{new_tokens / elapsed:.1f}", accept=f"{accepted / max(drafted, 1):.2f}",
                        running=engine.num_running)
    bar.close()
    wall = time.perf_counter() - t0
    summary = {"rows": len(rows), "completions": len(completions), "errors": len(errors),
               "new_tokens": new_tokens, "wall_s": round(wall, 2), "tokens_per_s": round(new_tokens / wall, 1),
               "draft_tokens": drafted, "accepted_tokens": accepted,
               "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
               "mean_tokens_per_round": round(new_tokens / max(len(rounds), 1), 3),
               "model_load_s": round(load_s, 1), "target": loaded.target_id, "draft": loaded.draft_id,
               "drafter": cfg.models.drafter, "config_hash": config_hash(cfg)}
    write_outputs(cfg, completions, rounds, errors, summary)
    return {"summary": summary, "completions": completions, "errors": errors}


def write_outputs(cfg: JobConfig, completions, rounds, errors, summary) -> None:
    fs, root = fsspec.core.url_to_fs(cfg.output.path)
    fs.makedirs(root, exist_ok=True)
    chash = config_hash(cfg)
    comp_rows = [{**asdict(c), "config_hash": chash,
                  "acceptance_rate": c.num_accepted / c.num_draft_tokens if c.num_draft_tokens else None}
                 for c in completions]
    tables = {"completions": comp_rows, "rounds": [asdict(r) for r in rounds], "errors": errors}
    for name, data in tables.items():
        with fs.open(f"{root}/{name}.parquet", "wb") as f:
            pq.write_table(pa.Table.from_pylist(data) if data else pa.table({}), f)
    with fs.open(f"{root}/summary.json", "w") as f:
        json.dump({**summary, "config": asdict(cfg)}, f, indent=2)
