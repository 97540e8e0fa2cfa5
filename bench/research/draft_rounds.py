"""Where a drafter's rounds go: the distribution of draft lengths, the accepted count per draft
length, and acceptance by draft position, over one engine run (SmolLM2, our engine).

    .venv/bin/python -m bench.research.draft_rounds --prompts bench/out/prompts_templated.json --n 48 --batch 4 \
        --temperature 0.7 --drafter suffix --suffix '{"min_match": 1}'

Tokens per round and steps are what the drafter buys; timing is not measured here (bench.run_one
does). Prints a Markdown summary; --out writes it as JSON too.
"""
from __future__ import annotations

import argparse
import collections
import json

import torch

from bench.common import load_prompts
from pipeline.engine import DraftingConfig, EngineConfig, SuffixParams
from pipeline.job.config import ModelsConfig
from pipeline.engine import SamplingParams
from pipeline.job.runtime import build_engine


def analyse(rounds) -> dict:
    by_len, by_len_acc = collections.Counter(), collections.Counter()
    reached, accepted = collections.Counter(), collections.Counter()
    for r in rounds:
        by_len[r.draft_len] += 1
        by_len_acc[r.draft_len, r.accepted] += 1
        for i in range(r.draft_len):
            reached[i] += 1
            accepted[i] += i < r.accepted
    n = sum(by_len.values())
    return {"rounds": n,
            "tokens_per_round": sum((a + 1) * c for (_, a), c in by_len_acc.items()) / n,
            "draft_len_share": {g: c / n for g, c in sorted(by_len.items())},
            "accepted_given_len": {g: {a: c / by_len[g] for (gg, a), c in sorted(by_len_acc.items()) if gg == g}
                                   for g in sorted(by_len)},
            "acceptance_by_position": {i: accepted[i] / reached[i] for i in sorted(reached)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True, help="JSON list of token-id prompts (chat template applied)")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--drafter", default="suffix", choices=["ngram", "suffix"])
    ap.add_argument("--suffix", default="{}", help="drafting.suffix fields as JSON")
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.n)
    models = ModelsConfig(target="smollm2-135m-instruct", dtype="float32", device="cpu")
    drafting = DraftingConfig(method=args.drafter, num_speculative_tokens=args.g,
                              suffix=SuffixParams(**json.loads(args.suffix)))
    section = EngineConfig(max_num_seqs=args.batch, max_model_len=max(map(len, prompts)) + args.max_tokens + 8,
                           max_prefill_tokens=2048)
    engine = build_engine(models, drafting, section).engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, seed=i)
    rounds, steps = [], 0
    while engine.has_unfinished():
        rounds += engine.step().rounds
        steps += 1
    res = {"args": vars(args), "steps": steps, **analyse(rounds)}
    print(f"{res['rounds']} rounds in {steps} steps, {res['tokens_per_round']:.3f} tokens/round")
    print("| draft length | share of rounds | accepted 0..g (share of those rounds) |\n|---|---|---|")
    for g, share in res["draft_len_share"].items():
        acc = ", ".join(f"{a}: {s:.2f}" for a, s in res["accepted_given_len"][g].items())
        print(f"| {g} | {share:.3f} | {acc} |")
    print("acceptance by draft position i (of the rounds that drafted position i, the share accepted through i): "
          + ", ".join(f"{i}: {a:.3f}" for i, a in res["acceptance_by_position"].items()))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
