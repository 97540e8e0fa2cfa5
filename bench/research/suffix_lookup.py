"""Cost of the suffix drafter's lookup and bookkeeping per sequence per round, without any model.

Synthetic templated job: prompts of ~200 tokens (a shared 150-token template, 50 varying tokens),
outputs that are a few formats with 10% of tokens changed. The worker-wide index first holds
`--cached` finished sequences; then `--batch` sequences run rounds of: propose (g tokens), commit
the accepted prefix of the draft plus one token of the sequence's true output, on_commit; finished
sequences are released into the index and replaced. Reports microseconds per sequence per round
(propose + on_commit + release, amortised) and the accepted length.

    .venv/bin/python -m bench.research.suffix_lookup [--batch 32] [--cached 300] [--rounds 200]

Memory of the worker-wide index under a long job (--memory): real token text (the bench's prompt
file, sequence after sequence, as many passes as it takes) flows through a SuffixCache of each
--caps size, so it fills and then evicts; reports nodes and the bytes Python allocated for the trie
(tracemalloc) once full, and after 3x the cap has passed through (bounded: the same).

    .venv/bin/python -m bench.research.suffix_lookup --memory --caps 8192,32768,131072
"""
from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc

from bench.common import load_prompts
from pipeline.engine import SamplingParams, SuffixDrafter, SuffixParams
from pipeline.engine.drafting.suffix import SuffixCache
from pipeline.engine.core.request import Sequence

VOCAB = 49152


def make_job(rng: random.Random, out_len: int):
    template = [rng.randrange(VOCAB) for _ in range(150)]
    formats = [[rng.randrange(VOCAB) for _ in range(out_len)] for _ in range(4)]

    def row() -> tuple[list[int], list[int]]:
        prompt = template + [rng.randrange(VOCAB) for _ in range(50)]
        truth = [t if rng.random() > 0.1 else rng.randrange(VOCAB) for t in rng.choice(formats)]
        return prompt, truth
    return row


def fresh(row, params) -> tuple[Sequence, list[int]]:
    prompt, truth = row()
    return Sequence("r", prompt, params, 0), truth


def run(batch: int, cached: int, rounds: int, g: int, out_len: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    row = make_job(rng, out_len)
    drafter = SuffixDrafter(SuffixParams(max_cached_tokens=1 << 20))
    params = SamplingParams(max_tokens=out_len, temperature=1.0)
    for _ in range(cached):
        prompt, truth = row()
        drafter.release(Sequence("c", prompt, params, 0, truth))
    running = [fresh(row, params) for _ in range(batch)]
    seq_rounds = accepted = 0
    elapsed = 0.0
    for _ in range(rounds):
        seqs = [s for s, _ in running]
        t0 = time.perf_counter()
        drafts = drafter.propose(seqs, [g] * len(seqs), [None] * len(seqs))
        elapsed += time.perf_counter() - t0
        for b, (seq, truth) in enumerate(running):
            want = truth[len(seq.output_ids):len(seq.output_ids) + g + 1]
            draft = drafts.tokens(b)
            k = next((i for i, (d, t) in enumerate(zip(draft, want)) if d != t), min(len(draft), len(want)))
            seq.output_ids += want[:k + 1]
            accepted += k
        t0 = time.perf_counter()
        drafter.on_commit(seqs)
        for b, (seq, truth) in enumerate(running):
            if len(seq.output_ids) >= len(truth):
                drafter.release(seq)
                running[b] = fresh(row, params)
        elapsed += time.perf_counter() - t0
        seq_rounds += len(seqs)
    return {"us_per_seq_round": 1e6 * elapsed / seq_rounds, "accepted_per_round": accepted / seq_rounds,
            "cached_tokens": drafter.cache.num_tokens, "cache_nodes": drafter.cache.trie.num_nodes}


def memory(cap: int, texts: list[list[int]], max_depth: int = 16) -> dict:
    """Fill a SuffixCache of `cap` tokens from `texts` (cycled), then stream 3x the cap through it."""
    tracemalloc.start()
    cache = SuffixCache(max_depth, cap)
    passed, i, out = 0, 0, {"cap_tokens": cap}
    while passed < 4 * cap:
        text = texts[i % len(texts)]
        cache.add(text)
        passed, i = passed + len(text), i + 1
        if "full_nodes" not in out and passed >= cap:
            out.update(full_nodes=cache.trie.num_nodes, full_mb=tracemalloc.get_traced_memory()[0] / 2**20)
    out.update(after_4x_nodes=cache.trie.num_nodes, after_4x_mb=tracemalloc.get_traced_memory()[0] / 2**20,
               peak_mb=tracemalloc.get_traced_memory()[1] / 2**20, held_tokens=cache.num_tokens,
               nodes_per_token=cache.trie.num_nodes / max(cache.num_tokens, 1))
    tracemalloc.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cached", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--memory", action="store_true", help="the index's memory under a long job instead")
    ap.add_argument("--caps", default="8192,32768,131072")
    ap.add_argument("--texts", default="bench/out/prompts_smollm2_256.json")
    args = ap.parse_args()
    if args.memory:
        texts = load_prompts(args.texts)
        for cap in map(int, args.caps.split(",")):
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in memory(cap, texts).items()}))
        return
    print(run(args.batch, args.cached, args.rounds, args.g, args.out_len))


if __name__ == "__main__":
    main()
