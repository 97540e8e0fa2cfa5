"""Micro-benchmark: one verify-shaped target forward (rows x tokens per row) over the slot store: our CPU
kernel (cpu), eager padded SDPA (off), compiled FlexAttention (on, auto), at chosen context lengths per row.

    .venv/bin/python -m bench.step_bench --threads 1 --repeats 7

Workloads (each row forwards --q tokens, as a round with g = q - 1 drafts does):
  uniform    32 rows of ~150 context tokens
  mixed      one row of 1,500 among 31 of ~150 (the eager path pads every row to the longest)
  long       32 rows of ~1,000
  batch1     1 row of ~150
Prints ms per step (median and spread over --repeats, after 2 warm-ups) and the mixed/uniform ratio
per mode. The KV contents are whatever the store holds: the cost does not depend on them.

    .venv/bin/python -m bench.step_bench --threads 2 --sweep 16,32,64,128,256 --q 1 --max-model-len 512

--linears panel,onednn,auto: each mode with our linear kernel, with oneDNN's packed weights, and with
the plan measured on this machine (calibrate.py: by rows, whichever is faster).

--sweep: running sequences (rows of ~300 context tokens) per step instead of the workloads, with
tokens/s = rows x q / step time: where more running sequences stop paying (engine.max_num_seqs).
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import spread
from pipeline.engine.model.runner import build_runner, ModelRunner
from pipeline.loading.models import ModelSpec, load_model

WORKLOADS = {
    "uniform": [150 + 3 * i for i in range(32)],
    "mixed": [1500] + [150 + 3 * i for i in range(31)],
    "long": [1000 + 3 * i for i in range(32)],
    "batch1": [150],
}


def time_step(runner: ModelRunner, contexts: list[int], q: int, repeats: int, first_q: int | None = None) -> list[float]:
    slots = list(range(len(contexts)))
    qs = [first_q or q] + [q] * (len(contexts) - 1)
    tokens = [[(7 * b + j) % 1000 + 10 for j in range(qs[b])] for b in range(len(contexts))]
    times = []
    for i in range(repeats + 2):
        runner.synchronize()
        t0 = time.perf_counter()
        runner.forward(slots, contexts, tokens)
        runner.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--q", type=int, default=5, help="tokens per row (g + 1)")
    ap.add_argument("--first-q", type=int, default=None, help="tokens of the first row only (one row drafts, "
                                                                "as in an adaptive step where the rest run g = 0)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--modes", default="cpu,off,on,auto",
                    help="cpu: our CPU kernel (Kernels.cpu_attention); off/on/auto: engine.compile with it off")
    ap.add_argument("--linears", default="panel",
                    help="panel: our CPU linear kernel everywhere; onednn: oneDNN-packed weights; auto: the measured plan")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--sweep", default="", help="comma-separated row counts (see the docstring)")
    args = ap.parse_args()
    if args.sweep:
        for rows in map(int, args.sweep.split(",")):
            WORKLOADS[f"rows{rows}"] = [300 + (7 * i) % 60 for i in range(rows)]
        args.workloads = ",".join(f"rows{r}" for r in args.sweep.split(","))
    torch.set_num_threads(args.threads)
    print(f"model {args.model} {args.dtype} on {args.device}, {args.threads} thread(s), {args.q} tokens/row")
    for mode, linear in [(m, lin) for m in args.modes.split(",") for lin in args.linears.split(",")]:
        model, _ = load_model(ModelSpec(args.model, args.dtype, args.device))
        t0 = time.perf_counter()
        runner = build_runner(model, max(len(WORKLOADS[w]) for w in args.workloads.split(",")),
                             args.max_model_len, compile="off" if mode == "cpu" else mode,
                             cpu_attention="on" if mode == "cpu" else "off",
                             cpu_linear={"panel": "on", "onednn": "off", "auto": "auto"}[linear])
        print(f"linear={linear}: {runner.plan.describe()}")
        medians = {}
        for name in args.workloads.split(","):
            contexts = WORKLOADS[name]
            t_first = time.perf_counter()
            times = time_step(runner, contexts, args.q, args.repeats, args.first_q)
            s = spread(times)
            med = medians[name] = s["median"]
            tokens = len(contexts) * args.q + (args.first_q - args.q if args.first_q else 0)
            rate = f"  {tokens / med:7.1f} tok/s" if args.sweep else ""
            print(f"mode={mode:4s} linear={linear:6s} flex={runner.flex or 'never'} {name:8s} rows={len(contexts):2d} "
                  f"median {med * 1e3:8.1f} ms  min {s['min'] * 1e3:8.1f}  max {s['max'] * 1e3:8.1f}  "
                  f"(first call incl. compile {time.perf_counter() - t_first - sum(times):.1f} s){rate}")
        if "mixed" in medians and "uniform" in medians:
            print(f"mode={mode}: mixed / uniform step time = {medians['mixed'] / medians['uniform']:.2f}x")
        del runner, model
        print(f"mode={mode}: total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
