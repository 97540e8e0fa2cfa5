"""How fast this machine reads memory on the engine's threads: the bound of a one-row step, whose linears stream
every weight once (bench/RESULTS.md, "CPU kernels").

    .venv/bin/python -m bench.research.read_bandwidth --threads 2 --gb 0.54

Reads a float32 buffer of --gb (0.54: the fp32 SmolLM2-135M weights) by torch.sum and by a vector-matrix product
(576 rows, SmolLM2's hidden size), --repeats times each; prints the best and the median GB/s.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gb", type=float, default=0.54)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cols = int(args.gb * 1e9 / 4 / 576)
    weights, vector = torch.ones(576, cols), torch.ones(576)
    gb = weights.numel() * 4 / 1e9
    for name, read in (("torch.sum", weights.sum), ("vector x matrix", lambda: vector @ weights)):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            read()
            times.append(time.perf_counter() - t0)
        print(f"{name}: {gb / min(times):.1f} GB/s best, {gb / statistics.median(times):.1f} median "
              f"({args.repeats} reads of {gb:.2f} GB, {args.threads} threads)")


if __name__ == "__main__":
    main()
