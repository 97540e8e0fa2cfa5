"""Drafting under a grammar: the round's proposal for a batch where some sequences have a
response_format. Per constrained sequence: the tokens the grammar forces ahead (its only
continuation: keys, quotes, separators, closing brackets), at no draft cost; then the drafter's own
tokens, cut at the first one the grammar forbids (propose_guided says when such a token stays);
then forced tokens again where the drafter's whole draft stood. A token tree (suffix, n-gram with
drafting.tree) hangs under the forced tokens ahead instead, and no forced tokens follow it.

The verifier's rule is unchanged (p is the target masked and renormalised); why these proposals
keep it exact is stated beside the cut (propose_guided) and in core/verify.py's glossary.

This module knows nothing about models or the verifier beyond the DraftBatch it returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..core.request import Sequence
from ..core.tree import MAX_INPUTS
from ..grammar.walk import GuideView, RoundWalk
from .base import DraftBatch, Drafter

MAX_FORCED = 16          # forced tokens per sequence and round, ahead and after the draft together


@dataclass
class GuidedDraft:
    """A proposal per sequence laid out as [forced ahead][drafted][forced after] (a tree: its tokens
    under the forced ones ahead, all counted as drafted)."""
    drafts: DraftBatch
    num_forced_ahead: list[int]    # [num_seqs] forced tokens at the start of each proposal
    num_drafted: list[int]         # [num_seqs] then the drafter's own tokens (as kept under the grammar)
    num_forced_after: list[int]    # [num_seqs] then forced tokens again

    def num_forced(self, b: int) -> int:
        return self.num_forced_ahead[b] + self.num_forced_after[b]

    def forced_rows(self, b: int) -> list[int]:
        """Sequence b's proposal positions that hold forced tokens (ahead of and after its drafted ones)."""
        ahead, drafted = self.num_forced_ahead[b], self.num_drafted[b]
        return [i for i in range(self.drafts.num_draft[b]) if i < ahead or i >= ahead + drafted]


def propose_guided(drafter: Drafter, seqs: list[Sequence], lengths: list[int], room: list[int],
                   generators: list[torch.Generator], walk: RoundWalk, forced_tokens: bool,
                   size_trees: Callable[[DraftBatch], DraftBatch] = lambda proposal: proposal) -> GuidedDraft:
    """The round's proposal (module docstring). lengths[b]: the drafter's tokens wanted; room[b]:
    proposal tokens at most (max_tokens and the context limit); `size_trees` cuts token trees to size.

    The drafter sees the forced tokens ahead as context; a draft model drafts under the grammar's
    mask (its q is the masked distribution). At the first drafted token the grammar forbids, a
    one-hot row (n-gram, suffix's most frequent walk, a greedy draft model) is cut there, and a row
    drawn from a spread q (suffix's sampled walk) keeps that token and drops the rest. Why this
    stays exact:
      - forced and cut one-hot proposals are functions of the committed prefix alone, as any
        token-only draft is: the proposal's length may depend on the prefix, never on a draw;
      - at a forbidden one-hot token y, verification would reject for sure (p(y) = 0) and draw from
        norm([p - onehot(y)]+) = p: exactly what ending the draft before y does (a bonus draw from p);
      - a token drawn from a spread q cannot be dropped on seeing it (that choice would depend on the
        draw): it stays, is rejected for sure, and the residual norm([p - q]+) is drawn, as the proof
        requires; only what follows it is dropped;
      - a draft model's q is masked by the same grammar before it draws, so the q the verifier divides
        by is the one the token came from, and no forbidden token is ever drawn.
    A forced token is accepted with probability p(token) = 1 when the mask allows only it; where the
    tokenizer can spell the forced bytes more than one way, the mask allows each spelling and the
    forced token is an ordinary one-hot draft."""
    n = len(seqs)
    limit = [min(MAX_FORCED, r) if forced_tokens and walk.is_constrained(b) else 0 for b, r in enumerate(room)]
    for b in range(n):
        walk.ahead[b] = walk.take_forced(b, limit[b])
    drafted_len = [max(0, min(g, room[b] - len(walk.ahead[b]), MAX_INPUTS - 1 - len(walk.ahead[b])))
                   for b, g in enumerate(lengths)]                  # a tree's inputs fit its visibility bits
    proposal = size_trees(drafter.propose(seqs, drafted_len, generators, GuideView(walk)))
    if proposal.is_tree:
        return _grafted(proposal, walk)
    keep, trailing, one_hot = [], [], None
    for b in range(n):
        tokens = proposal.tokens(b)
        k = len(tokens)
        if walk.is_constrained(b):
            k = walk.depth[b] - len(walk.ahead[b])          # a masked draft model consumed its own
            while k < len(tokens) and walk.advance(b, tokens[k]):
                k += 1
            whole = k == len(tokens)
            if not whole:
                one_hot = proposal.one_hot_rows() if one_hot is None else one_hot   # once, where a row needs it
                if not one_hot[b][k]:
                    k += 1                                   # drawn from a spread q: stays, to be rejected
            left = min(limit[b] - len(walk.ahead[b]), room[b] - len(walk.ahead[b]) - k)
            trailing.append(walk.take_forced(b, left) if whole else [])
        else:
            trailing.append([])
        keep.append(k)
    changed = any(walk.ahead) or any(trailing) or any(k < proposal.num_draft[b] for b, k in enumerate(keep))
    drafts = proposal.spliced(walk.ahead, keep, trailing) if changed else proposal
    return GuidedDraft(drafts=drafts, num_forced_ahead=[len(a) for a in walk.ahead], num_drafted=keep,
                       num_forced_after=[len(t) for t in trailing])


def _grafted(proposal: DraftBatch, walk: RoundWalk) -> GuidedDraft:
    """Token trees under the forced tokens ahead, checked against each constrained row's grammar at
    each token's parent's state (grammar/walk.py's walk_tree): a forbidden one-hot token is dropped
    with its subtree, a forbidden token drawn from a spread q kept without it (propose_guided's rules)."""
    kept, one_hot = [], proposal.one_hot_rows()
    for b in range(len(proposal.num_draft)):
        tree = proposal.parents_of(b)
        if walk.is_constrained(b):
            kept.append(walk.walk_tree(b, proposal.tokens(b), tree, one_hot[b]))
        else:
            kept.append(list(range(len(tree))))
    drafts = proposal.grafted(walk.ahead, kept)
    return GuidedDraft(drafts=drafts, num_forced_ahead=[len(a) for a in walk.ahead],
                       num_drafted=[len(k) for k in kept], num_forced_after=[0] * len(kept))
