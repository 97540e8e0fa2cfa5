"""Drafters side by side on three workloads: our engine with no draft, n-gram, suffix and
adaptive suffix, all at once and at batch 4, each configuration in its own process (bench/run_one.py).

    .venv/bin/python -m bench.drafter_workloads --n 16 --max-tokens 128 --out bench/out/drafters.json

Workloads (token-id prompt files, chat template applied):
  mixed      bench/out/prompts_smollm2_256.json   the main bench's prompts (MT-bench + HumanEval + CoQA)
  templated  bench/out/prompts_templated.json     the synthetic job's own prompts, 2 samples per prompt,
                                                  sampled at temperature 0.7 (bench/make_templated.py)
  grounded   bench/out/prompts_grounded.json      CoQA extraction + HumanEval only (make_prompts --grounded)
Greedy except `templated`. --drafters picks the configurations (e.g. none,ngram+adaptive), --batches
the running-sequence counts (all, b1, b4, b16...), --repeats the runs of each. Prints a Markdown table: tok/s, acceptance, tokens per round, speedup
over no draft on the same workload and batch, and the drafter's time per round per sequence
(draft phase seconds / sequence-rounds: the lookup cost, n-gram and suffix alike).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import load_prompts, run_config, spread

WORKLOADS = {"mixed": ("bench/out/prompts_smollm2_256.json", 0.0),
             "templated": ("bench/out/prompts_templated.json", 0.7),
             "grounded": ("bench/out/prompts_grounded.json", 0.0)}
DRAFTERS = "none,ngram,suffix,suffix+adaptive"    # drafter[+adaptive], compared with the first


def parse_drafters(spec: str) -> list[tuple[str, list[str]]]:
    out = []
    for item in spec.split(","):
        name, _, flag = item.partition("+")
        if flag not in ("", "adaptive"):
            raise SystemExit(f"--drafters: expected drafter or drafter+adaptive, got {item!r}")
        out.append((name, ["--adaptive"] if flag else []))
    return out


def run(workload: str, drafter: str, extra: list[str], batch: str, args, workdir: Path) -> dict:
    path, temperature = WORKLOADS[workload]
    prompts = load_prompts(path, args.n)
    pfile = workdir / f"prompts_{workload}_{args.n}.json"
    json.dump(prompts, open(pfile, "w"))
    name = f"{workload}_{drafter}{'_adaptive' if extra else ''}_{batch}"
    out = workdir / f"{name}.json"
    running = len(prompts) if batch == "all" else int(batch[1:])
    cfg = {"args": ["--mode", "engine", "--drafter", drafter, "--batch", str(running), "--max-tokens", str(args.max_tokens),
                    "--temperature", str(temperature), "--dtype", "float32", "--suffix", args.suffix, *extra]}
    res = run_config(cfg, "smollm2", pfile, out, [])
    if "error" in res:
        return {"name": name, "error": res["error"][-400:]}
    rounds = res["num_rounds"]
    return {"name": name, "workload": workload, "drafter": drafter + (" (adaptive)" if extra else ""),
            "batch": batch, "tok_s": res["tokens_per_s"], "acceptance": res["acceptance_rate"],
            "tokens_per_round": res["mean_tokens_per_round"], "draft_us_per_seq_round": 1e6 * res["draft_s"] / rounds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workloads", default="mixed,templated,grounded")
    ap.add_argument("--batches", default="all,b4", help="all (every prompt at once) and/or bN (N running)")
    ap.add_argument("--drafters", default=DRAFTERS, help="drafter or drafter+adaptive, comma-separated; "
                                                          "speedups are over the first (give none first)")
    ap.add_argument("--suffix", default="{}", help="drafting.suffix fields as JSON for the suffix runs")
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration (tok/s: median, min-max)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    workdir = Path(args.out).with_suffix("")
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    drafters = parse_drafters(args.drafters)
    for workload in args.workloads.split(","):
        for batch in args.batches.split(","):
            base = None
            for drafter, extra in drafters:
                runs = [run(workload, drafter, extra, batch, args, workdir) for _ in range(args.repeats)]
                row = runs[0]
                if "error" not in row:
                    rates = spread([r["tok_s"] for r in runs if "error" not in r])
                    row.update(tok_s=rates["median"], tok_s_min=rates["min"], tok_s_max=rates["max"])
                    base = row["tok_s"] if base is None else base
                    row["speedup"] = row["tok_s"] / base
                rows.append(row)
                print(json.dumps(row), flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)
    fmt = lambda v, f: "" if v is None else f.format(v)
    lines = ["| workload | batch | drafter | tok/s (median; min-max) | acceptance | tokens/round | speedup vs first | draft us/seq/round |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error'][-100:]!r} | | | | | | |")
            continue
        lines.append(f"| {r['workload']} | {r['batch']} | {r['drafter']} | {r['tok_s']:.1f} ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}) | "
                     f"{fmt(r['acceptance'], '{:.2f}')} | {r['tokens_per_round']:.2f} | {fmt(r['speedup'], '{:.2f}')} | "
                     f"{r['draft_us_per_seq_round']:.0f} |")
    table = "\n".join(lines)
    print(table)
    Path(args.out).with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
