"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975): drafts from what the text
so far, and what the other sequences of this worker, finished or running, continued with after the
same tokens (the indexes: suffix_index.py).

Per sequence, either a single path (`SuffixDrafter.lookup`: the better-scoring of its own index's
and the worker-wide index's walks, sampled from the counts with q where the sequence samples) or,
with `drafting.tree.max_tokens`, a token tree grown over both indexes at once (`lookup_tree`).
The drafter keeps one RequestIndex per running sequence in step with its committed tokens, and hands
a finished sequence's text to the worker-wide index.

This module knows nothing about models, verification or rounds.
"""
from __future__ import annotations

import torch

from ..config import SuffixParams, TreeParams
from ..core.request import Sequence
from ..core.verify import SparseProbs
from ..grammar.walk import GuideView
from .base import DraftBatch, FreeDrafter
from .suffix_index import RequestIndex, SuffixCache, Walk, merged_tree
from .trees import DraftTree


class SuffixDrafter(FreeDrafter):
    """Suffix drafts from the sequence's own history and the worker's other sequences. Owns one
    RequestIndex per running sequence, synchronised with its committed tokens on commit (and on
    propose) together with its running text in the worker-wide cache (index_running), dropped on
    release, when the finished sequence joins the worker-wide cache."""
    kind = "suffix"

    def __init__(self, params: SuffixParams = SuffixParams(), device="cpu", tree: TreeParams = TreeParams()):
        self.params, self.device, self.tree = params, device, tree
        self.cache = SuffixCache(params.max_depth, params.max_cached_tokens)
        self._own: dict[Sequence, RequestIndex] = {}

    def _synced(self, seq: Sequence) -> RequestIndex:
        own = self._own.get(seq)
        if own is None:
            own = self._own[seq] = RequestIndex(self.params.max_depth)
        if own.num_tokens < seq.num_tokens:
            new = seq.all_ids()[own.num_tokens:]
            own.append(new)
            if self.params.index_running:
                self.cache.extend(seq, new)
        return own

    def on_commit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._synced(seq)

    def release(self, seq: Sequence) -> None:
        self._own.pop(seq, None)
        self.cache.finish(seq, seq.all_ids())

    def lookup(self, seq: Sequence, k: int, generator: torch.Generator | None = None,
               ahead: list[int] = ()) -> Walk:
        """Up to k draft tokens for `seq` (after its tokens and then `ahead`, forced tokens already
        proposed): the better-scoring of its own index's and the worker-wide index's most-frequent
        walks (SuffixTrie.match: the rule and the score), its own winning ties. The sequence's own
        text is subtracted from the worker-wide counts (its own trie holds exactly that text), so the
        worker-wide walk is what the *other* sequences continued with.

        Where the sequence samples and sample_method is probabilistic, the winner's walk is taken
        again from the same node, each step drawing a child in proportion to its count (one uniform
        per step from `generator`) and stopping by the same running top-share rule; the draft then
        comes with q, the counts normalised over each node's children. The verifier accepts y with
        probability min(1, p(y) / q(y)) and resamples from norm([p - q]+), exact for any q
        (core/verify.py), so this is lossless like a one-hot draft; it gains where the target itself
        spreads over continuations the index has seen (several samples of one templated prompt):
        acceptance is then sum_y min(p(y), q(y)) instead of p(most frequent y). Greedy sequences keep
        the most-frequent walk, one-hot q."""
        empty = Walk([], 0.0, None)
        if k <= 0:
            return empty
        own = self._synced(seq)
        context = (seq.all_ids() + list(ahead))[-self.params.max_depth:]
        best = own.match(context, k, self.params)
        walk = best.walk(self.params.min_prob) if best is not None else empty
        if self.cache.num_tokens:
            minus = own if self.cache.is_indexed(seq) else None           # its own text: counted in `own`
            other = self.cache.trie.match(context, k, self.params, minus)
            if other is not None:
                other_walk = other.walk(self.params.min_prob)
                if other_walk.score > walk.score:
                    best, walk = other, other_walk
        if walk.tokens and self.params.sample_method == "probabilistic" and not seq.params.is_greedy:
            walk = best.walk(self.params.min_prob, torch.rand(best.limit, generator=generator).tolist())
        return walk

    def lookup_tree(self, seq: Sequence, size: int, generator: torch.Generator | None = None,
                    ahead: list[int] = ()) -> DraftTree:
        """A token tree of at most `size` tokens (and tree.max_tokens) for `seq` after its tokens and
        `ahead`, grown over its own index and the worker-wide one at once (merged_tree), at most
        tree.max_branches continuations per token, stopping below min_prob as the walk does; drawn
        from `generator` where the sequence samples and trees are sampled.

        Its depth is bounded by the tree's size and by half the indexed depth (max_depth / 2, the
        rest left to the match), not by the engine's path length nor by max_spec_factor: where the
        index is sure, the budget goes deep (SuffixDecoding's trees), where it is not, wide, and the
        estimates (min_prob, and the adaptive policy's per-depth calibration) price depth where the
        walk's length rule would cut it. Tree tokens are one-hot by default, for sampled sequences
        too: a node's children cover the continuations the index saw, the token accepted there is
        distributed as the target's whatever the draft, so the subtree entered is the one under the
        target's own choice, and the most frequent continuation gets the deepest. With tree.sampled,
        a sampled sequence's children are drawn from the merged estimates without replacement and
        carry q (drafting/trees.py): the first child then takes the largest subtree and is accepted
        with probability sum_y min(p(y), q(y)), which beats the most frequent one's p(y) only where
        the counts estimate p closely (measured: bench/RESULTS.md, "Token trees"). With
        max_branches 1 and one index the one-hot tree is the most-frequent walk (where
        max_spec_factor does not cut the walk)."""
        if size <= 0:
            return DraftTree([], [], [])
        own = self._synced(seq)
        context = (seq.all_ids() + list(ahead))[-self.params.max_depth:]
        depth = min(size, self.params.max_depth // 2)        # half the indexed depth is left to the match
        matches = [own.match(context, depth, self.params)]
        if self.cache.num_tokens:
            matches.append(self.cache.trie.match(context, depth, self.params,
                                                 own if self.cache.is_indexed(seq) else None))
        matches = [m for m in matches if m is not None]     # trees: deep as `depth`, not as a walk's limit
        if not matches:
            return DraftTree([], [], [])
        uniforms = None
        if self.tree.sampled and not seq.params.is_greedy:   # one uniform per draw: at most max_branches
                                                              # per token and the root
            draws = (self.tree.max_tokens + 1) * self.tree.max_branches
            uniforms = iter(torch.rand(draws, generator=generator).tolist())
        shape = TreeParams(min(size, self.tree.max_tokens), self.tree.max_branches, self.tree.sampled)
        return merged_tree(matches, depth, self.params.min_prob, shape, uniforms)

    def propose(self, seqs: list[Sequence], lengths: list[int], generators,
                guide: GuideView | None = None) -> DraftBatch:
        if self.tree.max_tokens:
            trees = [self.lookup_tree(s, g, gen, guide.ahead(b) if guide else ())
                     for b, (s, g, gen) in enumerate(zip(seqs, lengths, generators))]
            return DraftBatch.from_lists([t.tokens for t in trees], self.device, _sparse_q(trees, self.device),
                                         [t.parents for t in trees], [t.plan for t in trees])
        walks = [self.lookup(s, g, gen, guide.ahead(b) if guide else ())
                 for b, (s, g, gen) in enumerate(zip(seqs, lengths, generators))]
        return DraftBatch.from_lists([w.tokens for w in walks], self.device, _sparse_q(walks, self.device))


def _sparse_q(drafts: list[Walk] | list[DraftTree], device) -> SparseProbs | None:
    """q of a batch of walks or trees: their own where sampled, one-hot rows elsewhere; None where
    every draft is one-hot."""
    if all(d.q is None for d in drafts):
        return None
    rows = [d.q if d.q is not None else [([t], [1.0]) for t in d.tokens] for d in drafts]
    return SparseProbs.from_lists(rows, device)
