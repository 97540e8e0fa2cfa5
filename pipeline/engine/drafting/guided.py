"""Drafting under a grammar: the round's proposal for a batch where some sequences have a
response_format. Per constrained sequence, in order:

  1. forced tokens ahead: where the grammar admits exactly one continuation (keys, quotes,
     separators, closing brackets), its tokens are proposed first, at no draft cost;
  2. the drafter's own tokens, after them (it sees the forced tokens as context; a draft model
     drafts under the grammar's mask, so its q is the masked distribution);
  3. a check of the drafter's tokens against the grammar: at the first token it forbids, a one-hot
     row (n-gram, suffix's most frequent walk, a greedy draft model) is cut, and a row drawn from a
     spread q (suffix's sampled walk) keeps that token and drops the rest (see below);
  4. forced tokens again after the drafter's, if its whole draft stood and room is left.

A token tree (suffix, n-gram with drafting.tree) hangs under the forced tokens ahead instead: every
token is checked at its parent's state (grammar/walk.py's walk_tree), a forbidden one-hot token is
dropped with its subtree and a forbidden token drawn from a spread q is kept without it, by the rules
below; no forced tokens follow a tree.

Why this stays exact (the verifier's rule is unchanged; p is the target masked and renormalised):
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
tokenizer can spell the forced bytes more than one way, the mask allows each spelling and the forced
token is an ordinary one-hot draft.

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
    drafts: DraftBatch
    num_ahead: list[int]       # forced tokens at the start of each proposal
    num_own: list[int]         # then the drafter's tokens
    num_trailing: list[int]    # then forced tokens again

    def num_forced(self, b: int) -> int:
        return self.num_ahead[b] + self.num_trailing[b]


def propose_guided(drafter: Drafter, seqs: list[Sequence], lengths: list[int], room: list[int],
                   generators: list[torch.Generator], walk: RoundWalk, forced_tokens: bool,
                   sized: Callable[[DraftBatch], DraftBatch] = lambda found: found) -> GuidedDraft:
    """The round's proposal (module docstring). lengths[b]: the drafter's tokens wanted; room[b]:
    proposal tokens at most (max_tokens and the context limit); `sized` cuts token trees to size."""
    n = len(seqs)
    limit = [min(MAX_FORCED, r) if forced_tokens and walk.is_constrained(b) else 0 for b, r in enumerate(room)]
    for b in range(n):
        walk.ahead[b] = walk.take_forced(b, limit[b])
    own_len = [max(0, min(g, room[b] - len(walk.ahead[b]), MAX_INPUTS - 1 - len(walk.ahead[b])))
               for b, g in enumerate(lengths)]                  # a tree's inputs fit its visibility bits
    found = sized(drafter.propose(seqs, own_len, generators, GuideView(walk)))
    if found.is_tree:
        return _grafted(found, walk)
    keep, trailing, one_hot = [], [], None
    for b in range(n):
        tokens = found.tokens(b)
        k = len(tokens)
        if walk.is_constrained(b):
            k = walk.depth[b] - len(walk.ahead[b])          # a masked draft model consumed its own
            while k < len(tokens) and walk.advance(b, tokens[k]):
                k += 1
            whole = k == len(tokens)
            if not whole:
                one_hot = found.one_hot_rows() if one_hot is None else one_hot      # once, where a row needs it
                if not one_hot[b][k]:
                    k += 1                                   # drawn from a spread q: stays, to be rejected
            left = min(limit[b] - len(walk.ahead[b]), room[b] - len(walk.ahead[b]) - k)
            trailing.append(walk.take_forced(b, left) if whole else [])
        else:
            trailing.append([])
        keep.append(k)
    changed = any(walk.ahead) or any(trailing) or any(k < found.num_draft[b] for b, k in enumerate(keep))
    drafts = found.spliced(walk.ahead, keep, trailing) if changed else found
    return GuidedDraft(drafts, [len(a) for a in walk.ahead], keep, [len(t) for t in trailing])


def _grafted(found: DraftBatch, walk: RoundWalk) -> GuidedDraft:
    """Token trees under the forced tokens ahead, checked against each constrained row's grammar."""
    kept, one_hot = [], found.one_hot_rows()
    for b in range(len(found.num_draft)):
        tree = found.parents_of(b)
        if walk.is_constrained(b):
            kept.append(walk.walk_tree(b, found.tokens(b), tree, one_hot[b]))
        else:
            kept.append(list(range(len(tree))))
    drafts = found.grafted(walk.ahead, kept)
    return GuidedDraft(drafts, [len(a) for a in walk.ahead], [len(k) for k in kept], [0] * len(kept))
