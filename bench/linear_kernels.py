"""The CPU linear kernels side by side at the shapes a forward has: torch's `F.linear`, oneDNN's
packed linear and our panel kernel (pipeline/engine/backends/cpu/linear.py, csrc/panel_linear.c).

    .venv/bin/python -m bench.linear_kernels --threads 2 --weights qwen-mlp
    .venv/bin/python -m bench.linear_kernels --threads 2 --weights smollm2 --rows 1 2 4 8 24 64 256 2048
    .venv/bin/python -m bench.linear_kernels --threads 2 --weights smollm2 --dtype bfloat16   # bf16 panel: avx512_bf16

Weights (fp32, or --dtype bfloat16; far more than the caches together, as in a real forward):
  qwen-mlp  eight [8960 x 1536] (one Qwen2.5-1.5B MLP projection each, 440 MB)
  smollm2   every linear of SmolLM2-135M (30 layers x q, k, v, o, gate, up, down, and the 49152-row
            lm_head: 540 MB), i.e. the linears of one whole forward
times M rows, M = the tokens of one forward (1 = plain decoding at batch 1, 5 = verifying 4 draft
tokens, 40 = batch 8 x 5, 2048 = a prefill chunk). Median of --repeats timed passes after 2 warm-ups,
in milliseconds for all the weights, and GB/s of weight read (what bounds small M) for each kernel.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from pipeline.engine.backends.cpu.linear import PackedLinear, PanelLinear, policy

SHAPES = {   # (out, in, count)
    "qwen-mlp": [(8960, 1536, 8)],
    "smollm2": [(576, 576, 60), (192, 576, 60), (1536, 576, 60), (576, 1536, 30), (49152, 576, 1)],
}


def median_ms(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="qwen-mlp", choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16, 40])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernel = policy("on", torch.device("cpu"), dtype)
    gen = torch.Generator().manual_seed(0)
    linears = []
    for out_f, in_f, count in SHAPES[args.weights]:
        for _ in range(count):
            lin = torch.nn.Linear(in_f, out_f, bias=False)
            lin.weight.data = torch.randn(out_f, in_f, generator=gen).to(dtype)
            linears.append(lin)
    weight_gb = sum(lin.weight.numel() * lin.weight.element_size() for lin in linears) / 1e9
    packed = [PackedLinear(lin) for lin in linears]
    panels = [PanelLinear(lin, kernel) for lin in linears]
    rows = []
    print(f"{args.weights}: {len(linears)} weights, {weight_gb:.2f} GB {args.dtype}, {args.threads} threads")
    print("| rows | F.linear ms | oneDNN packed ms | panel ms | packed / panel | panel GB/s | panel vs 1 row |\n"
          "|---|---|---|---|---|---|---|")
    for m in args.rows:
        xs = {lin.in_features: torch.randn(m, lin.in_features, generator=gen).to(dtype) for lin in linears}
        with torch.no_grad():
            plain = median_ms(lambda: [F.linear(xs[lin.in_features], lin.weight) for lin in linears], args.repeats)
            onednn = median_ms(lambda: [p(xs[p.in_features]) for p in packed], args.repeats)
            ours = median_ms(lambda: [p(xs[p.in_features]) for p in panels], args.repeats)
        rows.append({"rows": m, "f_linear_ms": plain, "packed_ms": onednn, "panel_ms": ours})
        print(f"| {m} | {plain:.1f} | {onednn:.1f} | {ours:.1f} | {onednn / ours:.2f}x | {weight_gb / ours * 1e3:.1f} | "
              f"{ours / rows[0]['panel_ms']:.2f}x |", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
