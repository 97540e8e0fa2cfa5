"""Where a GPU step's time goes: compiles met in a timed run, and the host's view of batch-1 steps.

    python3 -m bench.research.gpu_profile                          # random-init SmolLM2-135M shape, bf16, CUDA
    python3 -m bench.research.gpu_profile --device cpu --tiny      # dry run of this script on a CPU

1. compiles: the n-gram tree at every prompt at once, compile on (FlexAttention), CUDA graphs on,
   run twice in one process (bench/gpu_bench.py's run_config, warm-up included), then with graphs
   off; dynamo's recompile log is on, and each line gives dynamo's counters for that run. A first
   run that is much slower than the second spent its time compiling.
2. host profile: batch 1, compile off, CUDA graphs on, drafter none and ngram-tree, each under
   cProfile: the functions with the most own time, then the most cumulative time. On a GPU the first
   call that waits for the device (a host copy of its results, a device copy of host data from
   pageable memory) absorbs the device's time for the step; the rest is the host's own work.

Prints everything; the same lines go to $OUT/gpu_profile.log when $OUT is set.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch._dynamo.utils as dynamo_utils

from bench.gpu_bench import (DTYPES, H200_HBM_BYTES_PER_S, describe, random_model, run_config, synthetic_prompts,
                             weight_bytes_per_step)
from pipeline.engine.backends.cuda.graphs import UNCAPTURED


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--shape", default="smollm2-135m-shape", help="a bench.gpu_bench shape")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape, 8 prompts, 16 new tokens: a dry run")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--config-s", type=float, default=8.0, help="timed seconds per run, at most")
    ap.add_argument("--top", type=int, default=22, help="functions listed per profile ordering")
    args = ap.parse_args()
    shape = "tiny" if args.tiny else args.shape
    run_args = argparse.Namespace(max_tokens=16 if args.tiny else 128, g=4, hbm_bytes_per_s=H200_HBM_BYTES_PER_S)
    model = random_model(shape, DTYPES[args.dtype], args.device)
    weight_bytes = weight_bytes_per_step(model)
    prompts = synthetic_prompts(8 if args.tiny else args.num_prompts, model.config.vocab_size, 100, 300)
    graphs = "on" if args.device == "cuda" else UNCAPTURED     # the padded forward without capture on CPU
    compile = "on"
    out = open(os.path.join(os.environ["OUT"], "gpu_profile.log"), "w") if os.environ.get("OUT") else None

    def say(text: str) -> None:
        print(text, flush=True)
        if out is not None:
            out.write(text + "\n")
            out.flush()

    torch._logging.set_logs(recompiles=True)

    def one(label: str, drafter: str, compile: str, graphs: str, batch: int) -> None:
        dynamo_utils.counters.clear()
        t0 = time.perf_counter()
        res = run_config(model, drafter, compile, graphs, batch, prompts, run_args, args.config_s, weight_bytes)
        say(f"[{label}] {describe(shape, res)}\n    dynamo: {dict(dynamo_utils.counters['stats'])}, frames "
            f"{dict(dynamo_utils.counters.get('frames', {}))} ({time.perf_counter() - t0:.1f} s with the warm-up)")

    say(f"== compiles: {shape}, {args.dtype} on {args.device}, {len(prompts)} prompts at once, drafter ngram-tree")
    one("first run, graphs on", "ngram-tree", compile, graphs, len(prompts))
    one("second run, graphs on", "ngram-tree", compile, graphs, len(prompts))
    one("graphs off", "ngram-tree", compile, "off", len(prompts))
    for drafter in ("none", "ngram-tree"):
        say(f"== host profile: batch 1, compile off, graphs {graphs}, drafter {drafter}")
        prof = cProfile.Profile()
        prof.enable()
        one(f"batch 1 {drafter}", drafter, "off", graphs, 1)
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
        stats.print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        say(text.getvalue())
    if out is not None:
        out.close()


if __name__ == "__main__":
    sys.exit(main())
