"""Token-id prompt files for the benchmark: real prompts, the target's chat template applied.

    .venv/bin/python -m bench.make_prompts --model smollm2-135m-instruct --n 256 --out bench/out/prompts_smollm2_256.json

Order: one MT-bench question (first turn) then two input-grounded prompts (HumanEval and CoQA,
alternating), repeated, so any prefix of the file is a mix of open and grounded prompts.
`--grounded`: CoQA and HumanEval only (answers copy the input: the drafter benchmark's third workload).
"""
from __future__ import annotations

import argparse
import json

from bench.prompts import build_prompt_ids, load_prompt_set
from pipeline.loading.models import ModelSpec, load_model


def interleaved(n: int) -> list[dict]:
    chat = load_prompt_set("mtbench", 80)
    half = (n - min(n // 3 + 1, len(chat))) // 2 + 1
    grounded = [x for pair in zip(load_prompt_set("humaneval", half), load_prompt_set("coqa", half)) for x in pair]
    records, ci, gi = [], 0, 0
    while len(records) < n:
        if ci < len(chat) and (len(records) % 3 == 0 or gi >= len(grounded)):
            records.append(chat[ci])
            ci += 1
        else:
            records.append(grounded[gi])
            gi += 1
    return records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer and chat template")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--grounded", action="store_true",
                    help="input-grounded prompts only (CoQA extraction and HumanEval, alternating)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    _, tokenizer = load_model(ModelSpec(args.model, "float32"))
    if args.grounded:
        half = args.n // 2 + 1
        pairs = zip(load_prompt_set("coqa", half), load_prompt_set("humaneval", half))
        records = [x for pair in pairs for x in pair][:args.n]
    else:
        records = interleaved(args.n)
    ids = build_prompt_ids(tokenizer, [r["messages"] for r in records])
    with open(args.out, "w") as f:
        json.dump(ids, f)
    print(f"{len(ids)} prompts ({', '.join(r['id'] for r in records[:6])}, ...) -> {args.out}")


if __name__ == "__main__":
    main()
