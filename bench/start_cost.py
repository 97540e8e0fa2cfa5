"""What an engine's start measures on this machine, cold and cached: the linear plan, the attention
and MLP plans, the slot count (`engine.max_num_seqs: auto`) and the adaptive policy's cost curves.

    .venv/bin/python -m bench.start_cost --model smollm2 --dtype float32 --out bench/out/start_fp32.json

Each start runs in a fresh process over one kernel cache folder of its own: the first finds no
measurement there (cold), the next ones read what it wrote (cached). The compiled kernels are copied
in from the user's kernel cache where it has them, so a cold start here measures and does not
compile (a first start on a new machine also compiles them: `--compile` leaves them out).
Prints seconds per part (measured, or read from the cache), and the whole start (the model's load, its
kernels, the measurements, the KV store's allocation).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = {"linear plan": "calibrate", "attention plan": "calibrate_attention", "MLP plan": "calibrate_mlp"}   # runner's
MEASURED = {"slot-rates": "slot rates", "cost-curves": "cost curves"}     # ModelRunner.measured's names


def _timed(seconds: dict, name: str, fn):
    @functools.wraps(fn)
    def run(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
    return run


def child(args) -> None:
    """One start, timed by part; prints its JSON."""
    from pipeline.engine.model import runner
    seconds: dict[str, float] = {}
    for name, function in PARTS.items():
        setattr(runner, function, _timed(seconds, name, getattr(runner, function)))
    measured = runner.ModelRunner.measured
    runner.ModelRunner.measured = (lambda self, name, *a, **k:
                                   _timed(seconds, MEASURED[name], measured)(self, name, *a, **k))
    from bench.common import MODELS
    from pipeline.engine import DraftingConfig, EngineConfig, Kernels
    from pipeline.job.config import ModelsConfig
    from pipeline.job.runtime import build_engine
    t0 = time.perf_counter()
    loaded = build_engine(ModelsConfig(target=MODELS[args.model][0], dtype=args.dtype, device="cpu"),
                          DraftingConfig(method="ngram", adaptive=True),
                          EngineConfig(max_num_seqs="auto", max_model_len=args.max_model_len, max_prefill_tokens=2048),
                          Kernels())
    loaded.engine.calibrate()
    total = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "total": total, "plan": loaded.plan_lines(),
                      "slots": loaded.engine.config.max_num_seqs, "costs_cached": loaded.engine.costs_cached}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=600)
    ap.add_argument("--starts", type=int, default=3, help="the cold start, then cached ones")
    ap.add_argument("--compile", action="store_true", help="leave the compiled kernels out: a cold start compiles")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from pipeline.engine.backends.cpu.build import cache_dir
    folder = Path(tempfile.mkdtemp(prefix="specpipe-start-"))
    if not args.compile:
        for lib in cache_dir().glob("*.so"):
            shutil.copy(lib, folder)
    env = dict(os.environ, SPECPIPE_KERNEL_CACHE=str(folder))
    cmd = [sys.executable, "-m", "bench.start_cost", "--child", "--model", args.model, "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len)]
    starts = []
    for i in range(args.starts):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        starts.append(json.loads(out.strip().splitlines()[-1]))
        kind = "cold" if i == 0 else "cached"
        parts = ", ".join(f"{k} {v:.2f}" for k, v in starts[-1]["seconds"].items())
        print(f"{kind}: start {starts[-1]['total']:.1f} s ({parts}); {starts[-1]['slots']} slots", flush=True)
    print("\n".join(starts[0]["plan"]))
    shutil.rmtree(folder, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "dtype": args.dtype, "starts": starts}, indent=1))


if __name__ == "__main__":
    main()
