"""NgramDrafter: prompt lookup. The longest suffix n-gram of a sequence's tokens (prompt + output) that
occurred before proposes what followed it there; token only (one-hot q) and free.

It knows nothing about models, verification or the engine's loop.
"""
from __future__ import annotations

import numpy as np
import torch

from ..core.request import Sequence
from ..grammar.walk import GuideView
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

    def lookup(self, seq: Sequence, k: int, ahead: list[int] = ()) -> list[int]:
        """Up to k tokens to follow seq's tokens and then `ahead` (forced tokens already proposed)."""
        if k <= 0:
            return []
        return ngram_lookup(np.asarray(seq.all_ids() + list(ahead), dtype=np.int64), self.min_n, self.max_n, k)

    def propose(self, seqs: list[Sequence], lengths: list[int],
                generators: list[torch.Generator], guide: GuideView | None = None) -> DraftBatch:
        return DraftBatch.from_lists([self.lookup(s, g, guide.ahead(b) if guide else ())
                                      for b, (s, g) in enumerate(zip(seqs, lengths))], self.device)

