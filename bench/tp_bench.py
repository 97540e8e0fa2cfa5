"""Tensor parallel against one rank, side by side in one run: the same prompts, greedy, every prompt
queued at once up to --batch running. On CPU the same cores in total (one rank: --threads; N ranks:
--threads / N each), ranks 1..N-1 in spawned processes serving rank 0's steps over gloo; on CUDA one GPU
per rank (rank r sees GPU r), NCCL between them.

    python -m bench.tp_bench --model qwen-0.5b --prompts bench/out/prompts_qwen_64.json --sizes 1 2 \\
        --batches 1 64 --max-tokens 32 --repeats 3 --out bench/out/tp.json
    python -m bench.tp_bench --device cuda --shape llama-3-8b-shape --sizes 1 2 --batches 1 64   # GPU check

Per (size, batch): tokens/s from the first step to the last token (load excluded), median / min / max of
--repeats, the share of rank 0's step time inside collectives (all-reduce, logits gather, step
broadcast), each rank's weight bytes, and whether the outputs equal one rank's. Configurations alternate
within each repeat. --shape: a random-init model of bench/gpu_bench.py's shapes, saved once as
safetensors so each rank reads its slices. Imports torch, transformers and pipeline.engine / loading only
(no Ray), as the GPU check needs.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import torch

from pipeline.engine import EngineConfig, SamplingParams, SpecEngine
from pipeline.engine.model.runner import ModelRunner
from pipeline.engine.parallel.group import free_address
from pipeline.job.replica import open_replica, serve_rank
from pipeline.loading.hardware import resolve_dtype
from pipeline.loading.models import ModelSpec
from pipeline.loading.shards import load_model_shard

MODELS = {"qwen-0.5b": "qwen2.5-coder-0.5b-instruct", "qwen-1.5b": "qwen2.5-coder-1.5b-instruct",
          "smollm2": "smollm2-135m-instruct"}


def _rank(source: str, dtype: str, device: str, address: str, rank: int, size: int, threads: int) -> None:
    if device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)        # before CUDA starts in this process
    torch.set_num_threads(threads)
    serve_rank(ModelSpec(source, dtype, device), address, rank, size, 900)


def saved_shape(shape: str, dtype: str) -> str:
    """A random-init model of `shape` saved as safetensors (once per process) for the ranks to read."""
    from bench.gpu_bench import random_model
    from pipeline.loading.models import DTYPES
    folder = os.path.join(tempfile.gettempdir(), f"specpipe-tp-{shape}-{dtype}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        random_model(shape, DTYPES[dtype], "cpu").save_pretrained(folder)
    return folder


def run(args, source: str, dtype: str, size: int, batch: int, prompts: list[list[int]]) -> dict:
    """One configuration in a process of its own (rank 0; its ranks spawned by it): its memory is its own."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "run.json")
        proc = multiprocessing.get_context("spawn").Process(target=_configuration,
                                                            args=(args, source, dtype, size, batch, prompts, out))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"tp {size} batch {batch}: exit status {proc.exitcode}")
        with open(out) as f:
            return json.load(f)


def _configuration(args, source, dtype, size, batch, prompts, out) -> None:
    with open(out, "w") as f:
        json.dump(measure(args, source, dtype, size, batch, prompts), f)


def measure(args, source: str, dtype: str, size: int, batch: int, prompts: list[list[int]]) -> dict:
    """One configuration: tokens/s, collective shares, weight bytes per rank, outputs."""
    threads = max(1, args.threads // size)
    torch.set_num_threads(threads)
    procs, tp = [], None
    spec = ModelSpec(source, dtype, args.device)
    if size > 1:
        address = free_address("127.0.0.1")
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(source, dtype, args.device, address, r, size, threads), daemon=True)
                 for r in range(1, size)]
        for p in procs:
            p.start()
        tp = open_replica(address, size, args.device, 900, 900)
    target = load_model_shard(spec, size, 0, tokenizer=False)[0]     # at size 1: the whole model
    cfg = EngineConfig(max_num_seqs=batch, max_model_len=max(len(p) for p in prompts) + args.max_tokens + 8,
                       max_prefill_tokens=2048)
    engine = SpecEngine(ModelRunner(target, cfg, tp=tp), None, cfg, eos_token_ids=[])
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
    held = engine.target.rank_weight_bytes
    share = {k: v / step_s for k, v in (tp.group.seconds.items() if tp is not None else ())}
    if tp is not None:
        tp.peers.stop()
        for p in procs:
            p.join(timeout=60)
        tp.group.close()
    print(f"tp {size} batch {batch}: {tokens / wall:.1f} tok/s, collectives "
          + (", ".join(f"{k} {v:.1%}" for k, v in share.items()) or "none"), file=sys.stderr, flush=True)
    return {"tok_s": tokens / wall, "share": share, "weight_bytes": held,
            "outputs": [done[str(i)] for i in range(len(prompts))]}


def prompts_for(args, batch: int) -> list[list[int]]:
    n = batch if batch > 1 else 4
    if args.prompts:
        with open(args.prompts) as f:
            return json.load(f)[:n]
    from bench.gpu_bench import SHAPES, synthetic_prompts
    return synthetic_prompts(n, SHAPES[args.shape][1]().vocab_size, 64, 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(MODELS), help="a shipped model (with --prompts)")
    source.add_argument("--shape", help="a random-init shape of bench/gpu_bench.py (random prompts)")
    ap.add_argument("--prompts", help="token-id prompt file (bench/make_prompts.py), with --model")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2, help="CPU: cores in total, split over the ranks")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/out/tp.json")
    args = ap.parse_args()
    if args.model and not args.prompts:
        ap.error("--model needs --prompts")
    dtype = resolve_dtype(args.dtype, args.device).dtype
    where = MODELS[args.model] if args.model else saved_shape(args.shape, dtype)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for batch in args.batches:
            prompts = prompts_for(args, batch)
            for size in args.sizes:
                runs.setdefault(f"{size}/{batch}", []).append(run(args, where, dtype, size, batch, prompts))
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
        json.dump({"args": vars(args), "dtype": dtype, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
