"""Drafters: propose up to g tokens per sequence. Proposers never verify.

The engine talks to a drafter only through the `Drafter` protocol below; it never reads or writes a
drafter's attributes. Implementations:

- DraftModelDrafter: a small model sharing the target's tokenizer, with its own slot KV store that
  follows the committed history (rollback = a length). It owns its per-sequence KV lengths and
  their catch-up. `sample_method` "greedy" proposes the draft's argmax (token only, one-hot q);
  "probabilistic" samples from q with the sequence's draft generator and keeps q for verification.
- NgramDrafter: prompt lookup over prompt + generated tokens (token only, free).
- HybridDrafter: a free token-only drafter's proposal (n-gram, or suffix.py's SuffixDrafter) where
  one exists, the draft model elsewhere.
- NoDrafter: draft length 0, i.e. plain autoregressive decoding through the same engine.

Every proposal is returned flat (DraftBatch): token ids of all sequences concatenated, with offsets.
This module knows nothing about verification, stops or cost models.
"""
from __future__ import annotations

import numpy as np
import torch

from ..core.request import Sequence
from .base import DraftBatch, FreeDrafter


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram
    (max_n down to min_n) of `tokens`. Empty when nothing matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)   # starts 0..length-1-n
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []



class NgramDrafter(FreeDrafter):
    kind = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4, device="cpu"):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: expected 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.device = min_n, max_n, device

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0:
            return []
        return ngram_lookup(np.asarray(seq.all_ids(), dtype=np.int64), self.min_n, self.max_n, k)

    def propose(self, seqs: list[Sequence], lengths: list[int],
                generators: list[torch.Generator]) -> DraftBatch:
        return DraftBatch.from_lists([self.lookup(s, g) for s, g in zip(seqs, lengths)], self.device)

