"""Acceptance of the suffix and n-gram drafters replayed over fixed texts, without a model.

A greedy target's output does not depend on the drafts, so the text a plain run produced is the text
every speculative run produces: replaying it round by round says exactly how many draft tokens each
drafter would have had accepted (a path: its longest prefix that matches the text; a tree: its deepest
path that does), in seconds instead of a model run per setting. Sampled texts replay exactly in
distribution for one-hot drafts (the n-gram drafter's, every tree, the suffix walk with
`sample_method: greedy`): the verifier tries a row's one-hot children in turn against the residual, so
the token it emits is distributed as the target's and a child is accepted exactly when that token is
one of them, which is what the replay counts on a text drawn from the target. (The suffix walk's
default for sampled rows, a draw from the counts with q, is not replayed.) Sequences run one at a time
(batch 1), each released to the worker-wide index when it ends, as the engine does.

    .venv/bin/python -m bench.run_one --model smollm2 --mode engine --drafter none --batch 1 \\
        --prompts bench/out/prompts_grounded.json --max-tokens 128 --out bench/out/plain_grounded.json
    .venv/bin/python -m bench.research.tree_replay --prompts bench/out/prompts_grounded.json \\
        --texts bench/out/plain_grounded.json

Reported per setting: accepted draft tokens per round, draft tokens per round, rounds.

With `--step-ms A,B` (a step's cost at batch 1: A ms, plus B ms per token it verifies; fit them to a
run's steps, e.g. run_one's `steps` and `wall_s`) each setting also gets its predicted speed against
the single path's, and each tree size an *oracle* row: every round drafts exactly the path of that
tree which the text accepts (nothing where it accepts nothing), so it pays for accepted tokens only.
From the same position no policy that drafts from trees of that size (any subtree, any size per round)
emits more tokens or verifies fewer; at that cost curve the oracle's speed bounds theirs, up to the
rounds such a policy would start elsewhere (a round that accepts less ends at another position, where
the index may hold another tree). Counting every non-verifying second into A favours fewer, larger
rounds, so the bound is generous to trees.
"""
from __future__ import annotations

import argparse
import json

from bench.common import load_texts
from pipeline.engine import SamplingParams, SuffixParams, TreeParams
from pipeline.engine.core.request import Sequence
from pipeline.engine.core.tree import children
from pipeline.engine.drafting.ngram import NgramDrafter
from pipeline.engine.drafting.suffix import SuffixDrafter


def accepted_depth(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """The depth of the deepest tree path that `truth` begins with (a path: parents 0..n-2)."""
    kids = children(parents)
    node, depth = -1, 0
    while depth < len(truth):
        nxt = [c for c in (kids[node + 1] if node >= 0 else kids[0]) if tokens[c] == truth[depth]]
        if not nxt:
            break
        node, depth = nxt[0], depth + 1
    return depth


def replay(drafter, prompts: list[list[int]], texts: list[list[int]], depth: int, tree: bool) -> dict:
    """Rounds over the texts, each a tree (`tree`) or a path of at most `depth` tokens."""
    rounds = accepted = drafted = 0
    per_round = []                                       # (draft tokens, accepted) of each round
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        seq = Sequence(f"r{i}", list(prompt), SamplingParams(temperature=0), 0)
        pos = 0
        while pos < len(text):
            room = min(depth, len(text) - pos - 1)       # a path's; a tree is sized by the KV room alone
            if tree:
                t = drafter.lookup_tree(seq, depth)
                tokens, parents = t.tokens, t.parents
            else:
                tokens = path_tokens(drafter, seq, room)
                parents = list(range(-1, len(tokens) - 1))
            n = accepted_depth(tokens, parents, text[pos:]) if tokens else 0
            rounds, accepted, drafted = rounds + 1, accepted + n, drafted + len(tokens)
            per_round.append((len(tokens), n))
            seq.output_ids.extend(text[pos:pos + n + 1])
            pos += n + 1
            drafter.on_commit([seq])
        drafter.release(seq)
    return {"accepted_per_round": accepted / rounds, "draft_per_round": drafted / rounds, "rounds": rounds,
            "per_round": per_round}


def tokens_per_ms(per_round: list[tuple[int, int]], step_ms: tuple[float, float], oracle: bool = False) -> float:
    """Emitted tokens per ms at a step cost of A + B x verified tokens (the root and the drafts; an
    oracle verifies the root and the accepted drafts only)."""
    a, b = step_ms
    ms = sum(a + b * (1 + (n if oracle else k)) for k, n in per_round)
    return sum(1 + n for _, n in per_round) / ms


def path_tokens(drafter, seq: Sequence, k: int) -> list[int]:
    """A single path's tokens: the suffix drafter's walk carries its probabilities beside them."""
    found = drafter.lookup(seq, k)
    return found.tokens if isinstance(drafter, SuffixDrafter) else found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True, help="token ids per prompt (JSON list of lists)")
    ap.add_argument("--texts", required=True, help="a plain run_one result: its `outputs` are the texts")
    ap.add_argument("--g", type=int, default=4, help="single paths: tokens per round")
    ap.add_argument("--tree-tokens", default="8,16,32")
    ap.add_argument("--tree-branches", type=int, default=4)
    ap.add_argument("--suffix", default="{}", help='drafting.suffix fields as JSON, e.g. {"max_depth": 32}')
    ap.add_argument("--ngram-min", type=int, default=2, help="drafting.ngram_min: the shortest n-gram matched")
    ap.add_argument("--step-ms", default=None,
                    help="A,B: a step costs A ms plus B ms per verified token; adds predicted speed and oracle rows")
    args = ap.parse_args()
    step_ms = tuple(map(float, args.step_ms.split(","))) if args.step_ms else None
    suffix = json.loads(args.suffix)
    prompts, texts = load_texts(args.texts, args.prompts)
    rows = []
    for kind in ("ngram", "suffix"):
        make = ((lambda t: NgramDrafter(args.ngram_min, tree=t)) if kind == "ngram"
                else (lambda t: SuffixDrafter(SuffixParams(**{"sample_method": "greedy", **suffix}), tree=t)))
        path = replay(make(TreeParams()), prompts, texts, args.g, False)
        rows.append((kind, f"path {args.g}", path, False, path))
        for size in map(int, args.tree_tokens.split(",")):
            shape = TreeParams(max_tokens=size, max_branches=args.tree_branches)
            tree = replay(make(shape), prompts, texts, size, True)
            rows.append((kind, f"tree {size}x{args.tree_branches}", tree, False, path))
            if step_ms:
                rows.append((kind, f"oracle of tree {size}x{args.tree_branches}", tree, True, path))
    cols = " speed vs path |" if step_ms else ""
    print(f"| drafter | draft | accepted/round | draft/round | rounds |{cols}\n|---|---|---|---|---|{'---|' if step_ms else ''}")
    for kind, name, r, oracle, path in rows:
        line = (f"| {kind} | {name} | {r['accepted_per_round']:.2f} | "
                f"{r['accepted_per_round'] if oracle else r['draft_per_round']:.2f} | {r['rounds']} |")
        if step_ms:
            speed = tokens_per_ms(r["per_round"], step_ms, oracle) / tokens_per_ms(path["per_round"], step_ms)
            line += f" {speed:.2f}x |"
        print(line)


if __name__ == "__main__":
    main()
