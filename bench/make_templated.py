"""The templated workload for drafter benchmarks: the scheduled synthetic-data job's own prompts.

    .venv/bin/python -m bench.make_templated --seeds-per-slot 16 --samples 2 --out bench/out/prompts_templated.json

Expands bench/templated.yaml (the synthetic job's single-stage form over its real seed set: answer /
new task for MT-bench questions, solve / new function for HumanEval stubs, qa / JSON questions for
CoQA passages) for one fixed slot exactly as jobs/synthetic_data.py does, then applies SmolLM2's chat template. Rows keep the job's order (seed
-> template -> sample), so several prompts share a template and each prompt is sampled `--samples`
times: the repetition a worker-wide suffix index can exploit. Sample with `run_one --temperature`.
"""
from __future__ import annotations

import argparse
import json

from bench.prompts import build_prompt_ids
from pipeline.loading.models import ModelSpec, load_model
from pipeline.synthetic.config import load_synthetic_config
from pipeline.synthetic.plan import load_seeds
from pipeline.synthetic.stages import expand


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench/templated.yaml")
    ap.add_argument("--seeds-per-slot", type=int, default=16)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--slot", default="2026-12-01T00")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer and chat template")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = load_synthetic_config(args.config, [f"synthetic.seeds_per_slot={args.seeds_per_slot}",
                                              f"synthetic.samples_per_seed={args.samples}"])
    rows = expand(load_seeds(cfg.synthetic, cfg.storage), cfg.synthetic, cfg.sampling, args.slot, cfg.run.seed)
    _, tokenizer = load_model(ModelSpec(args.model, "float32"))
    ids = build_prompt_ids(tokenizer, [[{"role": "user", "content": r["prompt"]}] for r in rows])
    json.dump(ids, open(args.out, "w"))
    templates = sorted({r["template"] for r in rows})
    print(f"{len(ids)} prompts ({len(templates)} templates: {', '.join(templates)}; median "
          f"{sorted(map(len, ids))[len(ids) // 2]} tokens) -> {args.out}")


if __name__ == "__main__":
    main()
