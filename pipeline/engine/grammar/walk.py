"""One round's walk of the grammar: each constrained sequence's Guide advances from its committed
tokens through the round's proposal, recording the token mask at every position on the way; after
verification it is settled back to the committed tokens (undoing only the rejected ones).

Position i of sequence b is the state after its committed tokens and the first i proposed ones: the
mask there restricts both the draft's q for proposal i (a draft model drafts under it) and the
target's p for target row i. A mask is computed at most once per position and round.

A token tree (core/tree.py) after the forced tokens ahead is walked depth first (`walk_tree`): each
token is checked at its parent's state, its own row's mask is the state after its path, and the walk
returns to the end of the forced tokens; the target's rows then take their masks per row rather than
per position. After verification `settle` consumes the accepted path's tokens past that point.

Masks travel as int32 bit words (bit t % 32 of word t // 32 allows token t), to the model's device
as they are, where core/sampling.py applies them to the logits.
"""
from __future__ import annotations

import torch

from .library import Guide


class RoundWalk:
    """The grammar walk of one round over a batch (guides[b] None: sequence b is unconstrained)."""

    def __init__(self, guides: list[Guide | None], words: int, vocab: int):
        self.guides, self.words, self.vocab = guides, words, vocab
        self.masks: list[list[torch.Tensor]] = [[] for _ in guides]     # per position: int32 [words]
        self.accepting: list[list[bool]] = [[] for _ in guides]         # after each consumed token
        self.depth = [0] * len(guides)                                   # tokens consumed this round
        self.ahead: list[list[int]] = [[] for _ in guides]               # forced tokens ahead of the draft
        self.row_masks: list[list[torch.Tensor] | None] = [None] * len(guides)   # tree rows: per target row

    def is_constrained(self, b: int) -> bool:
        return self.guides[b] is not None

    @property
    def any_constrained(self) -> bool:
        return any(g is not None for g in self.guides)

    def mask(self, b: int) -> torch.Tensor:
        """The int32 [words] mask of sequence b at its current position."""
        masks = self.masks[b]
        if len(masks) <= self.depth[b]:
            row = torch.empty(self.words, dtype=torch.int32)
            self.guides[b].fill_mask(row)
            masks.append(row)
        return masks[self.depth[b]]

    def allows(self, b: int, token: int) -> bool:
        return self._in(self.mask(b), token)

    def _in(self, mask: torch.Tensor, token: int) -> bool:
        return 0 <= token < self.vocab and bool((int(mask[token >> 5]) >> (token & 31)) & 1)

    def advance(self, b: int, token: int) -> bool:
        """Consume `token` if the grammar allows it here; False (nothing consumed) if not."""
        if not self.allows(b, token):
            return False
        guide = self.guides[b]
        guide.consume([token])
        self.depth[b] += 1
        self.accepting[b].append(guide.is_accepting)
        return True

    def take_forced(self, b: int, limit: int) -> list[int]:
        """Up to `limit` forced tokens from the current position, consumed; appended to the round's
        forced tokens ahead of the draft while nothing else was proposed."""
        taken = []
        if limit > 0:
            for token in self.guides[b].forced()[:limit]:
                if not self.advance(b, token):
                    break
                taken.append(token)
        return taken

    def walk_tree(self, b: int, tokens: list[int], parents: list[int], one_hot: list[bool]) -> list[int]:
        """Check sequence b's tree (after the tokens walked so far) against its grammar, depth first.
        A token the grammar forbids at its parent's state is dropped with its subtree where one_hot (a
        sure rejection that changes nothing: drafting/guided.py), and kept without its subtree where
        drawn from a spread q (rejected for sure, its residual drawn). Returns the kept tokens'
        indices in order (parents before children), and records the target's row masks: the current
        positions', then each kept token's (a kept forbidden token's row repeats its parent's: never used)."""
        guide, kids = self.guides[b], [[] for _ in range(len(tokens) + 1)]
        for i, p in enumerate(parents):
            kids[p + 1].append(i)
        kept, own_mask = set(), {}

        def visit(parent: int) -> None:
            here = self.mask(b) if parent < 0 else own_mask[parent]
            for i in kids[parent + 1]:
                token = tokens[i]
                if self._in(here, token):
                    kept.add(i)
                    guide.consume([token])
                    own_mask[i] = torch.empty(self.words, dtype=torch.int32)
                    guide.fill_mask(own_mask[i])
                    visit(i)
                    guide.rollback(1)
                elif not one_hot[i]:
                    kept.add(i)
                    own_mask[i] = here
        visit(-1)
        order = sorted(kept)
        self.row_masks[b] = self.masks[b][:self.depth[b] + 1] + [own_mask[i] for i in order]
        return order

    def allowed(self, rows: list[int], device) -> torch.Tensor | None:
        """[len(rows), words] int32 masks of sequences `rows` at their current positions (all bits set
        for unconstrained ones), on `device`; None when none of them is constrained."""
        if not any(self.is_constrained(b) for b in rows):
            return None
        bits = torch.full((len(rows), self.words), -1, dtype=torch.int32)
        for i, b in enumerate(rows):
            if self.is_constrained(b):
                bits[i] = self.mask(b)
        return bits.to(device)

    def target_allowed(self, num_draft: list[int], device) -> torch.Tensor:
        """[sum(g_b + 1), words] int32 masks for the target's rows, in the verifier's order (rows of
        sequence b: positions 0..g_b). A position past a proposed token the grammar refused (kept for
        a certain rejection, see drafting/guided.py) repeats the last mask: that row is never used."""
        bits = torch.full((sum(g + 1 for g in num_draft), self.words), -1, dtype=torch.int32)
        r = 0
        for b, g in enumerate(num_draft):
            if self.row_masks[b] is not None:             # a tree: one mask per row (walk_tree)
                bits[r:r + g + 1] = torch.stack(self.row_masks[b])
            elif self.is_constrained(b):
                self.mask(b)                              # the current (last) position's mask
                for i in range(g + 1):
                    bits[r + i] = self.masks[b][min(i, self.depth[b])]
            r += g + 1
        return bits.to(device)

    def settle(self, b: int, accepted: list[int], final: int | None) -> list[bool]:
        """Back to the committed tokens: undo the walked tokens past the accepted ones, consume the
        accepted ones not walked yet (a tree's path below the forced tokens), then the final
        (recovered or bonus) token. Returns, per committed token of the round, whether the grammar
        accepts after it (what gates stop strings)."""
        guide = self.guides[b]
        keep = min(len(accepted), self.depth[b])
        guide.rollback(self.depth[b] - keep)
        self.depth[b] = keep
        del self.accepting[b][keep:]
        del self.masks[b][keep + 1:]
        self.row_masks[b] = None
        for token in accepted[keep:]:
            if not self.advance(b, token):
                raise RuntimeError(f"the grammar refuses accepted token {token}, which it allowed in the tree walk")
        if final is not None and not self.advance(b, final):
            raise RuntimeError(f"the grammar refuses token {final}, which was drawn under its own mask")
        return self.accepting[b]


class GuideView:
    """What a drafter sees of the round's walk, for a subset of the batch (rows[i]: the walk's index
    of the drafter's sequence i): the forced tokens ahead of its draft, the masks at the current
    positions, and advancing past a drafted token."""

    def __init__(self, walk: RoundWalk, rows: list[int] | None = None):
        self.walk = walk
        self.rows = list(range(len(walk.guides))) if rows is None else rows

    def subset(self, indices: list[int]) -> "GuideView":
        return GuideView(self.walk, [self.rows[i] for i in indices])

    def ahead(self, i: int) -> list[int]:
        return self.walk.ahead[self.rows[i]]

    def allowed(self, indices: list[int], device) -> torch.Tensor | None:
        return self.walk.allowed([self.rows[i] for i in indices], device)

    def advance(self, i: int, token: int) -> None:
        b = self.rows[i]
        if self.walk.is_constrained(b) and not self.walk.advance(b, token):
            raise RuntimeError(f"the draft proposed token {token}, which its grammar mask forbids")
