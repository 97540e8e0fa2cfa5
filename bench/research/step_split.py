"""Where one decoding / verify step's time goes: linears (whichever kernel the linear plan runs, lm_head
apart), attention (our kernel), and the rest (every other op of the forward, and Python), on the real SmolLM2.

    .venv/bin/python -m bench.research.step_split --dtypes float32,bfloat16 --shapes 32x1,64x1,32x5,8x256@0 --fused auto,off
    .venv/bin/python -m bench.research.step_split --dtypes float32 --shapes 1x1,4x3,64x1 --fused auto --decoder auto,off
    .venv/bin/python -m bench.research.step_split --dtypes bfloat16 --shapes 1x1,64x1 --fused auto --decoder auto --linear auto,on

Each shape is rows x tokens per row at ~330 context (300-360), or from a given position (8x256@0: a
2048-token prefill chunk of 8 prompts). The kernels' calls are timed by
wrapping them (wall clock around each call; the kernels are synchronous on CPU); "rest" is the
step's wall time less those. Median over --repeats steps after 2 warm-ups; one process, one model
per dtype and setting (--fused: Kernels.cpu_fused, auto = RMSNorm and the MLP's SiLU product fused,
off = the model's modules; --decoder: Kernels.cpu_decoder, auto = the forward as one loop over our
kernels, off = the model's forward; --linear: Kernels.cpu_linear, auto = the plan measured on this machine,
on = our panel kernel at every row count, off = oneDNN's), their steps interleaved so the box's drift
hits every setting alike.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from pipeline.engine.backends.cpu import attention as cpu_attention, linear as cpu_linear
from pipeline.engine.model.runner import build_runner
from pipeline.loading.models import ModelSpec, load_model

SPENT: collections.Counter = collections.Counter()


def _timed(cls, name: str, key) -> None:
    orig = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = orig(self, *args, **kwargs)
        SPENT[key(self)] += time.perf_counter() - t0
        return out
    setattr(cls, name, wrapper)


def parse_shape(text: str) -> tuple[int, int, int | None]:
    """"RxQ" (rows x tokens at ~330 context) or "RxQ@S" (every row's tokens from position S: 8x256@0
    is a 2048-token prefill chunk)."""
    shape, _, start = text.partition("@")
    rows, q = map(int, shape.split("x"))
    return rows, q, int(start) if start else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--shapes", default="32x1,64x1,32x5", help="rows x tokens per row, comma-separated")
    ap.add_argument("--fused", default="auto,off", help="Kernels.cpu_fused settings to compare")
    ap.add_argument("--decoder", default="off", help="Kernels.cpu_decoder settings to compare")
    ap.add_argument("--linear", default="auto", help="Kernels.cpu_linear settings to compare")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _timed(cpu_attention.CpuAttention, "__call__", lambda self: "attention")
    _timed(cpu_linear.PlannedLinear, "run", lambda self: "lm_head" if self.out_features > 10_000 else "linears")
    _timed(cpu_linear.MergedPanels, "run", lambda self: "linears")
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    print("| dtype | cpu_fused / cpu_decoder / cpu_linear | rows x tokens | step ms | linears | lm_head | attention | rest |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        runners = {}
        for fused, decoder, linear in [(f, d, lin) for f in args.fused.split(",") for d in args.decoder.split(",")
                                       for lin in args.linear.split(",")]:
            model, _ = load_model(ModelSpec(args.model, dtype, "cpu"))
            runner = build_runner(model, max(r for r, _, _ in shapes), 1024, cpu_attention="on",
                                  cpu_linear=linear, cpu_fused=fused, cpu_decoder=decoder)
            print(f"cpu_fused={fused} cpu_decoder={decoder} cpu_linear={linear}: {runner.plan.describe()}")
            runners[f"{fused} / {decoder} / {linear}"] = runner
        for rows, q, start in shapes:
            contexts = [300 + (7 * i) % 60 if start is None else start for i in range(rows)]
            tokens = [[(7 * b + j) % 1000 + 10 for j in range(q)] for b in range(rows)]
            steps = {f: [] for f in runners}
            parts = {f: collections.defaultdict(list) for f in runners}
            for i in range(args.repeats + 2):
                for fused, runner in runners.items():      # interleaved: the box's drift hits both alike
                    SPENT.clear()
                    t0 = time.perf_counter()
                    runner.forward(list(range(rows)), contexts, tokens)
                    wall = time.perf_counter() - t0
                    if i >= 2:
                        steps[fused].append(wall)
                        for k in ("linears", "lm_head", "attention"):
                            parts[fused][k].append(SPENT[k])
                        parts[fused]["rest"].append(wall - sum(SPENT.values()))
            for fused in runners:
                cells = [f"{statistics.median(parts[fused][k]) * 1e3:.1f}"
                         for k in ("linears", "lm_head", "attention", "rest")]
                s = steps[fused]
                at = "" if start is None else f" from {start}"
                print(f"| {dtype} | {fused} | {rows} x {q}{at} | {statistics.median(s) * 1e3:.1f} "
                      f"[{min(s) * 1e3:.1f}-{max(s) * 1e3:.1f}] | " + " | ".join(cells) + " |", flush=True)
        del runners

if __name__ == "__main__":
    main()
