"""Free drafters replayed offline on recorded greedy outputs: tokens per round and acceptance for any
drafter setting in seconds, no model run.

    .venv/bin/python -m bench.research.drafter_sim --run bench/out/drafters/grounded_none_b4.json \
        --prompts bench/out/drafters/prompts_grounded_16.json --batch 4 \
        --suffix '{}' --suffix '{"max_spec_factor": 2}' --ngram

Greedy output does not depend on the drafts (the engine's exactness), so a round is replayed exactly:
the drafter proposes up to g tokens after the committed history, the accepted ones are the longest
prefix equal to the recorded continuation, plus one token from the target. On sampled output the
replay is exact in distribution for token-only drafts: a draft token x is accepted with probability
p(x), the probability that the recorded sample is x; so drafters compared on the same recorded
samples are compared paired, without the sample-to-sample spread of separate runs. The suffix
drafter's walk is replayed one-hot (`sample_method: greedy` unless --suffix says otherwise: the
verifier accepts a draw from the counts with min(1, p/q), which a recorded sample does not replay).
The batch is replayed round by round (at most `batch` running, admitted in order as slots free), so
the worker-wide suffix index sees finished and running sequences when the engine's would; the one
approximation is that prefill takes no rounds of its own. Tokens per round is what the drafter buys;
what a round costs is the engine bench's to measure (drafted tokens/round says how much more the
verify forward carries).
"""
from __future__ import annotations

import argparse
import json
from collections import deque

from bench.common import load_texts
from pipeline.engine.drafting.ngram import NgramDrafter
from pipeline.engine.core.request import SamplingParams, Sequence
from pipeline.engine.drafting.suffix import SuffixDrafter, SuffixParams, Walk


def replay(drafter, prompts: list[list[int]], outputs: list[list[int]], batch: int, g: int) -> dict:
    """Rounds of a continuous batch of at most `batch` sequences, admitted in input order as slots
    free, each round proposing for every running sequence before any commits (the engine's order)."""
    waiting, running = deque(range(len(prompts))), []
    rounds = drafted = accepted = 0
    while waiting or running:
        while waiting and len(running) < batch:
            i = waiting.popleft()
            running.append((Sequence(f"s{i}", list(prompts[i]), SamplingParams(max_tokens=len(outputs[i]), temperature=1.0), seed=0),
                            outputs[i]))
        drafts = []
        for seq, out in running:
            left = len(out) - len(seq.output_ids)
            found = drafter.lookup(seq, min(g, left - 1)) if left > 1 else []
            drafts.append(found.tokens if isinstance(found, Walk) else found)    # a suffix walk: tokens, scores
        for (seq, out), draft in zip(running, drafts):
            pos, n = len(seq.output_ids), 0
            while n < len(draft) and draft[n] == out[pos + n]:
                n += 1
            seq.output_ids.extend(out[pos:pos + n + 1])
            rounds, drafted, accepted = rounds + 1, drafted + len(draft), accepted + n
        drafter.on_commit([seq for seq, _ in running])
        for seq, out in running:
            if len(seq.output_ids) == len(out):
                drafter.release(seq)
        running = [(seq, out) for seq, out in running if len(seq.output_ids) < len(out)]
    emitted = sum(len(o) for o in outputs)
    return {"tokens_per_round": emitted / rounds, "drafted_per_round": drafted / rounds,
            "acceptance": accepted / drafted if drafted else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="a bench.run_one result (its outputs)")
    ap.add_argument("--prompts", required=True, help="the prompt ids that run used")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--g", type=int, default=4, help="draft tokens per round at most")
    ap.add_argument("--ngram", action="store_true", help="also the n-gram drafter (2..4)")
    ap.add_argument("--suffix", action="append", default=[], help="SuffixParams fields as JSON; repeatable")
    args = ap.parse_args()
    prompts, outputs = load_texts(args.run, args.prompts)
    drafters = [("ngram", NgramDrafter(2, 4))] if args.ngram else []
    drafters += [(f"suffix {s}", SuffixDrafter(SuffixParams(**{"sample_method": "greedy", **json.loads(s)})))
                 for s in args.suffix]
    for name, drafter in drafters:
        res = replay(drafter, prompts, outputs, args.batch, args.g)
        print(f"{name:50s} tokens/round {res['tokens_per_round']:.3f}  drafted/round "
              f"{res['drafted_per_round']:.2f}  acceptance {res['acceptance'] or 0:.3f}")


if __name__ == "__main__":
    main()
