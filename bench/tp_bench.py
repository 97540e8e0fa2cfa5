"""Tensor parallel against one rank, side by side in one run: the same prompts, greedy, every prompt
queued at once up to --batch running, the same cores in total (one rank: --threads; N ranks: --threads / N
each, ranks 1..N-1 in spawned processes serving rank 0's steps over gloo).

    python -m bench.tp_bench --model qwen-0.5b --prompts bench/out/prompts_smollm2_64.json --sizes 1 2 \\
        --batches 1 64 --max-tokens 64 --repeats 3 --out bench/out/tp.json

Per (size, batch): tokens/s from the first step to the last token (load excluded), median / min / max of
--repeats, the share of rank 0's step time inside collectives (all-reduce, logits gather, step
broadcast), each rank's weight bytes, and whether the outputs equal one rank's. Configurations alternate
within each repeat.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time

import torch

from bench.common import load_prompts
from pipeline.engine import DraftingConfig, EngineConfig, SamplingParams
from pipeline.engine.parallel.group import free_address
from pipeline.job.config import ModelsConfig
from pipeline.job.replica import open_replica, serve_rank
from pipeline.job.runtime import build_engine
from pipeline.loading.hardware import resolve_dtype
from pipeline.loading.models import ModelSpec

MODELS = {"qwen-0.5b": "qwen2.5-coder-0.5b-instruct", "qwen-1.5b": "qwen2.5-coder-1.5b-instruct",
          "smollm2": "smollm2-135m-instruct"}


def _rank(target: str, dtype: str, address: str, rank: int, size: int, threads: int) -> None:
    torch.set_num_threads(threads)
    serve_rank(ModelSpec(target, dtype), address, rank, size, 600)


def run(args, size: int, batch: int, prompts: list[list[int]]) -> dict:
    """One configuration: (tokens/s, collective share, weight bytes per rank, outputs)."""
    target, dtype = MODELS[args.model], resolve_dtype(args.dtype, "cpu").dtype
    threads = max(1, args.threads // size)
    torch.set_num_threads(threads)
    procs, tp = [], None
    if size > 1:
        address = free_address("127.0.0.1")
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(target, dtype, address, r, size, threads), daemon=True)
                 for r in range(1, size)]
        for p in procs:
            p.start()
        tp = open_replica(address, size, "cpu", 600, 600)
    max_len = max(len(p) for p in prompts) + args.max_tokens + 8
    loaded = build_engine(ModelsConfig(target=target, dtype=dtype), DraftingConfig(method="none"),
                          EngineConfig(max_num_seqs=batch, max_model_len=max_len, max_prefill_tokens=2048), tp=tp)
    engine = loaded.engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    if tp is not None:
        tp.group.seconds.clear()
    t0, step_s, done = time.perf_counter(), 0.0, {}
    while engine.has_unfinished():
        s0 = time.perf_counter()
        out = engine.step()
        step_s += time.perf_counter() - s0
        done.update({c.request_id: c.output_ids for c in out.finished})
    wall = time.perf_counter() - t0
    tokens = sum(len(o) for o in done.values())
    held = tp.weight_bytes if tp is not None else {0: engine.target.weight_bytes}
    share = {k: v / step_s for k, v in (tp.group.seconds.items() if tp is not None else ())}
    if tp is not None:
        tp.peers.stop()
        for p in procs:
            p.join(timeout=60)
        tp.group.close()
    print(f"tp {size} batch {batch}: {tokens / wall:.1f} tok/s, collectives "
          + (", ".join(f"{k} {v:.1%}" for k, v in share.items()) or "none"), file=sys.stderr)
    return {"tok_s": tokens / wall, "share": share, "weight_bytes": held,
            "outputs": [done[str(i)] for i in range(len(prompts))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen-0.5b")
    ap.add_argument("--prompts", required=True, help="token-id prompt file (bench/make_prompts.py)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2, help="cores in total, split over the ranks")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/out/tp.json")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for batch in args.batches:
            prompts = load_prompts(args.prompts, batch if batch > 1 else 4)
            for size in args.sizes:
                runs.setdefault(f"{size}/{batch}", []).append(run(args, size, batch, prompts))
    summary = {}
    for key, rs in runs.items():
        size, batch = key.split("/")
        rates = [r["tok_s"] for r in rs]
        base = runs[f"{args.sizes[0]}/{batch}"]
        summary[key] = {"tok_s_median": statistics.median(rates), "tok_s_min": min(rates), "tok_s_max": max(rates),
                        "collective_share": rs[-1]["share"], "weight_bytes": rs[-1]["weight_bytes"],
                        "same_outputs": all(r["outputs"] == b["outputs"] for r, b in zip(rs, base))}
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
