"""The shipped three-stage synthetic config (task -> answer -> judge) over one slot, with its default
drafter against plain decoding, side by side:

    .venv/bin/python -m bench.synthetic_bench --slot 2026-12-01T00 --repeats 2 --out bench/out/synthetic.json

Arms, alternating within each repeat, each a fresh `jobs/synthetic_data.py` process (its own local Ray)
writing to a fresh folder:
    default   configs/synthetic.yaml as shipped: adaptive n-gram drafts, grammar-forced tokens drafted
              for the judge's JSON (drafting.forced_tokens true)
    plain     drafting.method none and drafting.forced_tokens false: every stage decodes one token per
              target forward; the judge's rows are constrained plain decoding (the grammar masks, nothing
              is forced ahead)
Per stage and arm: rows, kept, flags, tokens, generate tokens/s (the run's tokens over its dispatch
time: load included, Ray start excluded), wall s, tokens per round, acceptance, forced tokens; medians
and [min, max] over the repeats. Sampled rows (temperature 0.8-1.0 as configured) draw other samples
under another drafter, so later stages see other (equally distributed) inputs: compare rates, not rows.
Extra arguments go to both arms (e.g. `synthetic.seeds_per_slot=8`).

    .venv/bin/python -m bench.synthetic_bench --judge-from out/synthetic/slot=2026-12-01T00 --repeats 3 \
        --out bench/out/synthetic_judge.json synthetic.seeds_per_slot=null

--judge-from: the judge alone on the same rows in every arm. Each arm's output starts as a copy of that
committed slot's stages before the last (their `_SUCCESS` kept; the last stage and the slot's commit
files left out), so the rerun skips them and runs only the judge over the same kept answers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ARMS = {"default": [], "plain": ["drafting.method=none", "drafting.forced_tokens=false"]}
STAGE_KEYS = ("rows", "kept", "tokens", "generate_tokens_per_s", "wall_s", "tokens_per_round", "acceptance_rate",
              "forced_tokens")


def seeded_output(arm: str, slot: str, judge_from: str | None) -> str:
    """A fresh output folder; with judge_from, holding that slot's committed stages but the last."""
    out = tempfile.mkdtemp(prefix=f"synthetic-bench-{arm}-")
    if judge_from:
        stages = sorted(d for d in os.listdir(judge_from) if d.startswith("stage="))
        last = json.load(open(os.path.join(judge_from, "summary.json")))["stages"][-1]["id"]
        for d in stages:
            if d != f"stage={last}":
                shutil.copytree(os.path.join(judge_from, d), os.path.join(out, f"slot={slot}", d))
    return out


def run_arm(arm: str, slot: str, config: str, extra: list[str], judge_from: str | None = None) -> dict:
    out = seeded_output(arm, slot, judge_from)
    cmd = [sys.executable, "jobs/synthetic_data.py", "--config", config, "--slot", slot, "--show", "0",
           f"output.path={out}", "run.progress=false", *ARMS[arm], *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.load(open(os.path.join(out, f"slot={slot}", "summary.json")))
    stages = {s["id"]: {**{k: s.get(k) for k in STAGE_KEYS}, "flagged": s["flagged"]} for s in summary["stages"]}
    return {"arm": arm, "process_s": round(time.time() - t0, 1), "slot_wall_s": summary["wall_s"], "stages": stages,
            "output": out}


def spread(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None}
    return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slot", default="2026-12-01T00")
    ap.add_argument("--config", default="configs/synthetic.yaml")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--judge-from", help="a committed slot folder: run only its last stage, on its rows, per arm")
    ap.add_argument("--out", required=True)
    ap.add_argument("extra", nargs="*", help="config overrides for both arms")
    args = ap.parse_args()
    runs = []
    for r in range(args.repeats):
        for arm in (args.arms if r % 2 == 0 else list(reversed(args.arms))):
            slot = os.path.basename(args.judge_from.rstrip("/")).removeprefix("slot=") if args.judge_from else args.slot
            runs.append(run_arm(arm, slot, args.config, args.extra, args.judge_from))
            stages = runs[-1]["stages"]
            print(f"repeat {r} {arm}: " + "; ".join(f"{s}: {v['tokens']} tok, {v['generate_tokens_per_s']} tok/s, "
                                                     f"{v['tokens_per_round']} tok/round"
                                                     for s, v in stages.items()), flush=True)
    table = {}
    for arm in args.arms:
        mine = [x for x in runs if x["arm"] == arm]
        table[arm] = {s: {k: spread([x["stages"][s][k] for x in mine]) for k in STAGE_KEYS if k != "rows"}
                      | {"rows": [x["stages"][s]["rows"] for x in mine],
                         "flagged": [x["stages"][s]["flagged"] for x in mine]}
                      for s in mine[0]["stages"]}
        table[arm]["slot_wall_s"] = spread([x["slot_wall_s"] for x in mine])
    if set(args.arms) == set(ARMS):
        for s in table["default"]:
            if s == "slot_wall_s":
                continue
            d, p = table["default"][s]["generate_tokens_per_s"]["median"], table["plain"][s]["generate_tokens_per_s"]["median"]
            print(f"{s}: default {d} tok/s, plain {p} tok/s" + (f", {d / p:.2f}x" if d and p else ""))
    json.dump({"runs": runs, "table": table, "argv": sys.argv}, open(args.out, "w"), indent=2)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
