"""One target forward with a token tree against the same tokens as single paths, on the real SmolLM2
(or any shipped model): does a tree's attention cost more than a path's at the same token count?

    .venv/bin/python -m bench.research.tree_step --repeats 25

Shapes (rows at ~330-345 context; the tree: 16 draft tokens under a root, 3 root children, at most 3
per node, 8 deep):
  4x5 paths        four rows of 5 tokens (batch 4, a 4-token path each)
  17 tree + 3x1    one row's 17-token tree and three 1-token rows (batch 4, one row drafted a tree)
  17 chain + 3x1   the same token counts, the long row causal
  1x17 tree / 1x17 chain / 1x5 chain   batch 1
Median ms per forward (min-max) over --repeats after 3 warm-ups, the shapes interleaved so the box's
drift hits all alike; one process, 2 threads, the model's kernels as a job would choose them.

    .venv/bin/python -m bench.research.tree_step --curve --repeats 20

--curve: batch 1 only, one row of 1..17 tokens (a chain) at context 330, and the least-squares line
through those medians (A + B x tokens: what `bench.research.tree_replay --step-ms` takes, with A raised by
the step's cost outside the forward).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.engine.model.runner import build_runner
from pipeline.loading.models import ModelSpec, load_model

TREE = [-1, -1, -1, 0, 0, 1, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11]
SHAPES = {
    "4x5 paths": ([list(range(10, 15))] * 4, None),
    "17 tree + 3x1": ([list(range(10, 27)), [5], [6], [7]], [TREE, None, None, None]),
    "17 chain + 3x1": ([list(range(10, 27)), [5], [6], [7]], None),
    "1x17 tree": ([list(range(10, 27))], [TREE]),
    "1x17 chain": ([list(range(10, 27))], None),
    "1x5 chain": ([list(range(10, 15))], None),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--curve", action="store_true", help="batch 1, one chain of 1..17 tokens, and a line through it")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(ModelSpec(args.model, args.dtype, "cpu"))
    runner = build_runner(model, 4, 1024)
    if args.curve:
        curve(runner, args.repeats)
        return
    times = {name: [] for name in SHAPES}
    for i in range(args.repeats + 3):
        for name, (tokens, parents) in SHAPES.items():
            slots = list(range(len(tokens)))
            t0 = time.perf_counter()
            runner.forward(slots, [330 + 5 * s for s in slots], tokens, parents=parents)
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    print(f"{runner.plan}")
    print("| shape | ms per forward (min-max) |\n|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}) |")


def curve(runner, repeats: int) -> None:
    """ms per batch-1 forward of n = 1..17 tokens, interleaved, and the line through the medians."""
    sizes = range(1, 18)
    times = {n: [] for n in sizes}
    for i in range(repeats + 3):
        for n in sizes:
            t0 = time.perf_counter()
            runner.forward([0], [330], [list(range(10, 10 + n))])
            if i >= 3:
                times[n].append(time.perf_counter() - t0)
    medians = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    line = statistics.linear_regression(list(medians), list(medians.values()))
    print(f"{runner.plan}")
    print("| tokens | ms per forward (min-max) |\n|---|---|")
    for n, ts in times.items():
        print(f"| {n} | {medians[n]:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}) |")
    print(f"line: {line.intercept:.2f} + {line.slope:.3f} x tokens ms")


if __name__ == "__main__":
    main()
