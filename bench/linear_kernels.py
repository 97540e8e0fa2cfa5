"""Why the engine packs its linears on CPU: torch's `F.linear` against the oneDNN-packed linear
(pipeline/engine/cpu_linear.py) at verify shapes.

    .venv/bin/python -m bench.linear_kernels --threads 2

Eight [8960 x 1536] fp32 weights (one Qwen2.5-1.5B MLP projection each, 440 MB together, far more
than the caches, as in a real forward) times M rows, M = the tokens of one forward (1 = plain
decoding at batch 1, 5 = verifying 4 draft tokens, 40 = batch 8 x 5). Median of 20 timed calls after
2 warm-ups, in milliseconds for all eight weights.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from pipeline.engine.cpu_linear import PackedLinear


def median_ms(fn, repeats: int = 20) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16, 40])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    linears = [torch.nn.Linear(1536, 8960, bias=False) for _ in range(8)]
    for lin in linears:
        lin.weight.data = torch.randn(8960, 1536, generator=gen)
    packed = [PackedLinear(lin) for lin in linears]
    rows = []
    print("| rows | F.linear ms | packed ms | F.linear / packed | F.linear vs 1 row | packed vs 1 row |\n|---|---|---|---|---|---|")
    for m in args.rows:
        x = torch.randn(m, 1536, generator=gen)
        with torch.no_grad():
            plain = median_ms(lambda: [F.linear(x, lin.weight) for lin in linears])
            fast = median_ms(lambda: [p(x) for p in packed])
        rows.append({"rows": m, "f_linear_ms": plain, "packed_ms": fast})
        print(f"| {m} | {plain:.1f} | {fast:.1f} | {plain / fast:.2f}x | {plain / rows[0]['f_linear_ms']:.2f}x | "
              f"{fast / rows[0]['packed_ms']:.2f}x |", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
