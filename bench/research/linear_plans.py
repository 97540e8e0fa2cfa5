"""Two linear plans side by side on the real SmolLM2: one forward of each step shape per plan in turn
(interleaved, so the box's drift hits both alike), median ms and the ratio.

    .venv/bin/python -m bench.research.linear_plans --plans "panel<=4 amx<=32 onednn<=64" "panel<=8 onednn<=16" \
        --shapes 1x5,1x9,4x3,8x5,16x1,32x1,64x1 --repeats 12

A plan is written as LinearPlan.describe() writes it ("panel<=4 amx<=32 onednn": rows 1-4 the panel kernel,
5-32 the AMX kernel, more oneDNN), every family alike; shapes are rows x tokens per row at ~330 context,
logits for every token (a verify step's).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from pipeline.engine.backends.cpu.linear import LinearPlan
from pipeline.engine.model.runner import build_runner
from pipeline.loading.models import ModelSpec, load_model


def parse_plan(text: str) -> LinearPlan:
    segments = []
    for part in text.split():
        kind, _, last = part.partition("<=")
        segments.append((int(last) if last else 1 << 20, kind))
    return LinearPlan(tuple(segments))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--plans", nargs=2, required=True, help="the two plans, as LinearPlan.describe() writes them")
    ap.add_argument("--shapes", default="1x5,1x9,4x3,16x1,32x1,64x1", help="rows x tokens, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(ModelSpec(args.model, args.dtype, "cpu"))
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    runners = {p: build_runner(copy.deepcopy(model), max(r for r, _ in shapes), 1024, cpu_attention="on",
                               linear_plan=parse_plan(p)) for p in args.plans}
    first, second = args.plans
    print(f"| rows x tokens | {first} ms | {second} ms | ratio |")
    print("|---|---|---|---|")
    for rows, q in shapes:
        contexts = [300 + (7 * i) % 60 for i in range(rows)]
        tokens = [[(7 * b + j) % 1000 + 10 for j in range(q)] for b in range(rows)]
        times = {p: [] for p in runners}
        for i in range(args.repeats + 2):
            for p, runner in runners.items():
                t0 = time.perf_counter()
                runner.forward(list(range(rows)), contexts, tokens)
                if i >= 2:
                    times[p].append(time.perf_counter() - t0)
        a, b = statistics.median(times[first]), statistics.median(times[second])
        print(f"| {rows} x {q} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
