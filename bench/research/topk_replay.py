"""What a draft model's top-k trees would have had accepted, replayed over a greedy target's texts:
the measurement that decides whether the draft model should propose trees.

A greedy target's text does not depend on the drafts, so one teacher-forced forward of the draft
model over prompt + text gives, at every position, what the draft would propose there after the
text so far. A round at position t then accepts, exactly as the engine would:

  path g        the draft's argmax chain: the run of positions t, t+1, ... (at most g) where the
                draft's argmax is the text's token;
  tree k x g    the draft's top k tokens at t, each followed by its own argmax chain of g - 1 tokens
                (k x g draft tokens): 0 where the text's token at t is not among the top k, else 1
                plus the argmax run from t + 1 (the chain under the text's token is conditioned on
                that token, which is what the teacher-forced logits at t + 1 are);

and the round moves past its accepted tokens and one more (recovered or bonus), as at batch 1.

    .venv/bin/python -m bench.research.topk_replay --draft qwen2.5-coder-0.5b-instruct \\
        --prompts bench/out/trees_qwen_b4/prompts_grounded_b4.json \\
        --texts bench/out/trees_qwen_b4/grounded_b4_plain_0.json

Reported per setting: accepted draft tokens per round, draft tokens per round, rounds.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import load_texts
from pipeline.loading.models import ModelSpec, load_model


def runs(hits: list[bool], start: int, limit: int) -> int:
    """How many of hits[start], hits[start + 1], ... are True in a row, at most `limit`."""
    n = 0
    while n < limit and start + n < len(hits) and hits[start + n]:
        n += 1
    return n


def replay(ranks: list[list[int]], k: int, g: int) -> dict:
    """ranks[i][j]: the rank of text i's token j among the draft's logits there (0: its argmax)."""
    rounds = accepted = drafted = 0
    for text_ranks in ranks:
        top1 = [r == 0 for r in text_ranks]
        pos = 0
        while pos < len(text_ranks):
            if k == 1:
                n = runs(top1, pos, g)
            else:
                n = 0 if text_ranks[pos] >= k else 1 + runs(top1, pos + 1, g - 1)
            rounds, accepted, drafted = rounds + 1, accepted + n, drafted + k * g
            pos += n + 1
    return {"accepted_per_round": accepted / rounds, "draft_per_round": drafted / rounds, "rounds": rounds}


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", required=True, help="the draft model (registry name or path)")
    ap.add_argument("--prompts", required=True, help="token ids per prompt (JSON list of lists)")
    ap.add_argument("--texts", required=True, help="a greedy plain run_one result: its `outputs` are the texts")
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--k", default="1,2,3,4", help="first-position branches (1: the path)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    prompts, texts = load_texts(args.texts, args.prompts)
    model, _ = load_model(ModelSpec(args.draft, args.dtype))
    ranks = []
    for prompt, text in zip(prompts, texts):
        logits = model(input_ids=torch.tensor([prompt + text])).logits[0, len(prompt) - 1:-1].float()
        truth = torch.tensor(text)
        at = logits.gather(1, truth[:, None])
        before = torch.arange(logits.shape[1])[None, :] < truth[:, None]       # argmax takes the first of ties
        ranks.append(((logits > at) | ((logits == at) & before)).sum(dim=1).tolist())
    print("| draft | accepted/round | draft/round | rounds |\n|---|---|---|---|")
    for k in map(int, args.k.split(",")):
        r = replay(ranks, k, args.g)
        name = f"path {args.g}" if k == 1 else f"tree top-{k} x {args.g}"
        print(f"| {name} | {r['accepted_per_round']:.2f} | {r['draft_per_round']:.2f} | {r['rounds']} |")


if __name__ == "__main__":
    main()
