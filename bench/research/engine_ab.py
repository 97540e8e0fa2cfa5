"""Plain and the default drafter (adaptive n-gram) as two engines in one process, run alternately (ABBA)
over the same prompts: each run's wall and its full steps' median forward (verify) time.

    .venv/bin/python -m bench.research.engine_ab --prompts bench/out/prompts_creative_240.json --n 240 --dtype float32 --repeats 2

Separates what the default's step costs from what differs between processes: both engines see the same
machine state, and the order alternates. Nothing else may run meanwhile (2 cores).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def run(engine, prompts: list[list[int]], tag: str, max_tokens: int, full: int) -> tuple[float, float, int]:
    from pipeline.engine import SamplingParams
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0), seed=0)
    steps, t0 = {}, time.perf_counter()
    while engine.has_unfinished():
        for r in engine.step().rounds:
            steps[r.step] = (r.batch_size, r.verify_s)
    wall = time.perf_counter() - t0
    engine.reset_prefix_cache()
    return wall, statistics.median(v for b, v in steps.values() if b == full) * 1e3, len(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists (bench.make_prompts)")
    ap.add_argument("--n", type=int, default=240)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--slots", type=int, default=32, help="engine.max_num_seqs")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import torch

    from pipeline.engine import DraftingConfig, EngineConfig
    from pipeline.job.config import ModelsConfig
    from pipeline.job.runtime import build_engine
    torch.set_num_threads(2)
    prompts = json.load(open(args.prompts))[:args.n]
    engines = {}
    for name, method in (("plain", "none"), ("default", "ngram")):
        engine = build_engine(ModelsConfig(target="smollm2-135m-instruct", dtype=args.dtype),
                              DraftingConfig(method=method, adaptive=method != "none"),
                              EngineConfig(max_num_seqs=args.slots, max_prefill_tokens=2048,
                                           max_model_len=max(map(len, prompts)) + args.max_tokens + 8)).engine
        engine.calibrate()
        run(engine, prompts[:2], "warm", 8, 2)
        engines[name] = engine
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for rep in range(args.repeats):
        for name in (engines if rep % 2 == 0 else list(engines)[::-1]):
            wall, step_ms, num_steps = run(engines[name], prompts, f"r{rep}", args.max_tokens, args.slots)
            results[name].append((wall, step_ms))
            print(f"{rep} {name}: wall {wall:.2f} s, full-step forward median {step_ms:.2f} ms, {num_steps} steps", flush=True)
    for name, runs in results.items():
        print(f"{name}: wall median {statistics.median(w for w, _ in runs):.2f} s, "
              f"full-step median {statistics.median(m for _, m in runs):.2f} ms")


if __name__ == "__main__":
    main()
