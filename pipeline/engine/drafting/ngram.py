"""NgramDrafter: prompt lookup. The longest suffix n-gram of a sequence's tokens (prompt + output) that
occurred before proposes what followed it there; token only (one-hot q) and free.

Token trees (`drafting.tree.max_tokens` > 0): every earlier occurrence of that n-gram (the latest
MAX_OCCURRENCES) offers what followed it, and the tree is grown best-first over those continuations
(drafting/trees.py): a token's estimated path probability is the share of the occurrences that
continue with its path, ties going to the latest occurrence. One occurrence gives its path alone.

It knows nothing about models, verification or the engine's loop.
"""
from __future__ import annotations

import numpy as np
import torch

from ..config import TreeParams
from ..core.request import Sequence
from ..grammar.walk import GuideView
from .base import DraftBatch, FreeDrafter
from .trees import DraftTree, grow_tree

MAX_OCCURRENCES = 64        # trees: the latest occurrences of the matched n-gram whose continuations count


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


def ngram_continuations(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[tuple[int, ...]]:
    """What followed each earlier occurrence (latest first, at most MAX_OCCURRENCES) of the longest
    suffix n-gram of `tokens` that occurred before, up to k tokens each. Empty when nothing matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            return [tuple(tokens[h + n:h + n + k].tolist()) for h in hits[::-1][:MAX_OCCURRENCES]]
    return []


def _followers(continuations: list[tuple[int, ...]]):
    """The trees' index: a state is a path (tuple); its continuations are the next tokens of the
    continuations that start with it, counted, in order of their latest occurrence."""
    def follow(path: tuple[int, ...]) -> list[tuple[int, int, tuple[int, ...]]]:
        counts: dict[int, int] = {}
        for c in continuations:
            if len(c) > len(path) and c[:len(path)] == path:
                counts[c[len(path)]] = counts.get(c[len(path)], 0) + 1
        total = sum(counts.values())
        return [(n / total, t, path + (t,)) for t, n in counts.items()]
    return follow


class NgramDrafter(FreeDrafter):
    kind = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4, device="cpu", tree: TreeParams = TreeParams()):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: expected 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.device, self.tree = min_n, max_n, device, tree

    def lookup(self, seq: Sequence, k: int, ahead: list[int] = ()) -> list[int]:
        """Up to k tokens to follow seq's tokens and then `ahead` (forced tokens already proposed)."""
        if k <= 0:
            return []
        return ngram_lookup(np.asarray(seq.all_ids() + list(ahead), dtype=np.int64), self.min_n, self.max_n, k)

    def lookup_tree(self, seq: Sequence, size: int, ahead: list[int] = ()) -> DraftTree:
        """A tree of at most `size` tokens (and tree.max_tokens) to follow seq's tokens and `ahead`."""
        if size <= 0:
            return DraftTree([], [], [])
        found = ngram_continuations(np.asarray(seq.all_ids() + list(ahead), dtype=np.int64), self.min_n,
                                    self.max_n, size)
        return grow_tree((), _followers(found), size, min(size, self.tree.max_tokens), self.tree.max_branches, 0.0)

    def propose(self, seqs: list[Sequence], lengths: list[int],
                generators: list[torch.Generator], guide: GuideView | None = None) -> DraftBatch:
        if self.tree.max_tokens:
            trees = [self.lookup_tree(s, g, guide.ahead(b) if guide else ()) for b, (s, g) in enumerate(zip(seqs, lengths))]
            return DraftBatch.from_lists([t.tokens for t in trees], self.device, None,
                                         [t.parents for t in trees], trees)
        return DraftBatch.from_lists([self.lookup(s, g, guide.ahead(b) if guide else ())
                                      for b, (s, g) in enumerate(zip(seqs, lengths))], self.device)

