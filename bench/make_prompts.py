"""Token-id prompt files for the benchmark: real prompts, the target's chat template applied.

    .venv/bin/python -m bench.make_prompts --model smollm2-135m-instruct --n 256 --out bench/out/prompts_smollm2_256.json

Order: one MT-bench question (first turn) then two input-grounded prompts (HumanEval and CoQA,
alternating), repeated, so any prefix of the file is a mix of open and grounded prompts.
`--grounded`: CoQA and HumanEval only (answers copy the input: the drafter benchmark's third workload).
`--creative`: open creative requests (poems, letters, dialogues about 24 subjects, shuffled), none from
the datasets: answers share little with their prompts, so an n-gram drafter finds almost nothing to
propose (the workload for what the default drafter costs where it drafts nothing).
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


SUBJECTS = ["a lighthouse keeper", "a retired astronaut", "a fox in winter", "a baker in Lisbon", "a chess prodigy",
            "an old violin", "a desert caravan", "a robot gardener", "a night train", "a lost umbrella", "a beekeeper",
            "a submarine cook", "a mountain village", "a paper boat", "a clockmaker", "a street musician",
            "a glacier", "a city pigeon", "a forgotten library", "a tea merchant", "a storm at sea", "a kite festival",
            "an abandoned mine", "a jazz pianist"]
FORMS = ["Write a short poem about {}.", "Tell a brief story about {} in the first person.",
         "Describe a day in the life of {}.", "Write a letter from {} to a friend.",
         "Invent a myth that explains the origin of {}.", "Write a dialogue between {} and a stranger.",
         "Describe {} to someone who has never seen it.", "Write a song chorus about {}.",
         "Give three unusual facts someone might imagine about {}.", "Write a diary entry by {}."]


def creative(n: int) -> list[dict]:
    """n of the 240 creative requests, in a fixed shuffled order."""
    import random
    messages = [[{"role": "user", "content": form.format(s)}] for form in FORMS for s in SUBJECTS]
    random.Random(7).shuffle(messages)
    if n > len(messages):
        raise ValueError(f"--creative has {len(messages)} prompts, asked for {n}")
    return [{"id": f"creative-{i}", "messages": m} for i, m in enumerate(messages[:n])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer and chat template")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--grounded", action="store_true",
                    help="input-grounded prompts only (CoQA extraction and HumanEval, alternating)")
    ap.add_argument("--creative", action="store_true", help="open creative requests, none from the datasets")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    _, tokenizer = load_model(ModelSpec(args.model, "float32"))
    if args.creative:
        records = creative(args.n)
    elif args.grounded:
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
