"""Our CPU attention kernel (csrc/slot_attention.c) alone, at SmolLM2's shapes (9 query heads, 3 KV
heads, head size 64), against the same kernel built from an earlier commit's source, and (--amx) our AMX
kernel (csrc/amx_attention_bf16.c).

    .venv/bin/python -m bench.research.attention_kernel --against b86b6a5~1 --dtypes float32,bfloat16
    .venv/bin/python -m bench.research.attention_kernel --dtypes bfloat16 --amx     # and our AMX kernel

Shapes (one layer's call, made for each of SmolLM2's 30 layers):
  prefill   8 rows x 256 new tokens from position 0 (a 2048-token prefill chunk, causal)
  decode    64 rows x 1 token at ~330 context (plain decoding, all at once)
  verify    32 rows x 5 tokens at ~300 context (verifying 4 drafts per row)
  b1-path   1 row x 5 tokens at 330 (batch 1, a 4-token path)
  b1-tree   1 row x 17 tokens at 330 (batch 1, a 16-token tree: its cost does not depend on the shape)
  b4-tree   one row of 17 tokens and three of 1 at ~300-330 (batch 4, one row drafted a tree)
Median of --repeats passes after a warm-up, ms per pass over 30 layers, and GFLOP/s (4 x heads x dim
x keys seen, summed over queries). As in a forward, each layer has its own store (a pass streams 30
layers' keys and values from memory, as a decoding step does; `--one-store` times one layer's store
30 times, warm in the caches) and the queries are values of the store's dtype (a bf16 model's are
bf16). Every output is checked against the plain-torch reference first (the AMX kernel's against the
reference that rounds the softmax numerators to bf16 as it does).
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.common import ROOT
from pipeline.engine.backends.cpu import build as cpu_kernels
from pipeline.engine.backends.cpu.attention import SOURCE, CpuAttention, amx_kernel, amx_unavailable, reference

SHAPES = {"prefill": [(0, 256)] * 8, "decode": [(330 + i % 30, 1) for i in range(64)],
          "verify": [(300 + i % 30, 5) for i in range(32)], "b1-path": [(330, 5)], "b1-tree": [(330, 17)],
          "b4-tree": [(330, 17), (300, 1), (310, 1), (320, 1)]}
HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def source_at(rev: str, into: Path) -> Path:
    """The kernel's C source (and the headers beside it) as of `rev`, written under `into`."""
    rel = SOURCE.relative_to(ROOT)
    out = into / SOURCE.name
    out.write_text(subprocess.run(["git", "show", f"{rev}:{rel}"], capture_output=True, text=True, check=True).stdout)
    listing = subprocess.run(["git", "ls-tree", "--name-only", rev, f"{rel.parent}/"], capture_output=True,
                             text=True, check=True).stdout.split()
    for name in (n for n in listing if n.endswith(".h")):
        (into / Path(name).name).write_text(subprocess.run(["git", "show", f"{rev}:{name}"], capture_output=True,
                                                           text=True, check=True).stdout)
    return out


def case(rows, dtype, gen, layers: int):
    """The call's query and row table, and `layers` (store K, store V) pairs."""
    n, cap = len(rows), max(s + m for s, m in rows) + 8
    stores = [(torch.randn(n, KV_HEADS, cap, DIM, generator=gen).to(dtype),
               torch.randn(n, KV_HEADS, cap, DIM, generator=gen).to(dtype)) for _ in range(layers)]
    first = [0]
    for _, m in rows:
        first.append(first[-1] + m)
    table = torch.tensor([list(range(n)), [s for s, _ in rows], [m for _, m in rows], first[:-1]], dtype=torch.long)
    query = torch.randn(first[-1], HEADS, DIM, generator=gen).to(dtype).float()
    flops = sum(4 * HEADS * DIM * sum(s + i + 1 for i in range(m)) for s, m in rows)
    return query, stores, table, flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default=None, help="a git revision whose kernel source to time as well")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="KV store dtypes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--one-store", action="store_true", help="one layer's store, 30 times (cache-warm)")
    ap.add_argument("--amx", action="store_true", help="also our AMX kernel (bf16 stores, CPUs with amx_bf16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {"this": CpuAttention(cpu_kernels.build(SOURCE))}
    tmp = Path(tempfile.mkdtemp(prefix="attention-kernel-"))
    if args.against:
        kernels[args.against] = CpuAttention(cpu_kernels.build(source_at(args.against, tmp)))
    if args.amx:
        why = amx_unavailable(torch.device("cpu"), torch.bfloat16, DIM)
        if why:
            raise SystemExit(f"--amx: {why}")
        kernels["AMX"] = amx_kernel()
    print("| store | shape | " + " | ".join(f"{k} ms x{LAYERS} | GFLOP/s" for k in kernels) + " |")
    print("|---|---|" + "---|---|" * len(kernels))
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for name, rows in SHAPES.items():
            query, stores, table, flops = case(rows, dtype, torch.Generator().manual_seed(0),
                                               1 if args.one_store else LAYERS)
            stores = stores * (LAYERS // len(stores))
            want = reference(query, *stores[0], table, DIM ** -0.5)
            cells = []
            for label, kernel in kernels.items():
                q = query
                if label == "AMX":                      # bf16 queries, numerators rounded to bf16 (its reference)
                    if dtype != torch.bfloat16:
                        cells.append("- | -")
                        continue
                    q = query.bfloat16()
                    got = kernel(q, *stores[0], table, DIM ** -0.5).float()
                    rounded = reference(q, *stores[0], table, DIM ** -0.5, rounded_p=True).float()
                    torch.testing.assert_close(got, rounded, atol=2e-2, rtol=2 ** -7)
                else:
                    got = kernel(query, *stores[0], table, DIM ** -0.5)
                    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
                times = []
                for _ in range(args.repeats + 1):
                    t0 = time.perf_counter()
                    for k_store, v_store in stores:
                        kernel(q, k_store, v_store, table, DIM ** -0.5)
                    times.append(time.perf_counter() - t0)
                med = sorted(times[1:])[len(times[1:]) // 2]
                cells.append(f"{med * 1e3:.1f} | {flops * LAYERS / med / 1e9:.1f}")
            print(f"| {str(dtype).removeprefix('torch.')} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
