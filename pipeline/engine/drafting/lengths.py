"""How much each row drafts this round: one object the engine asks, whatever `drafting.adaptive` says.

`FixedLengths` drafts `num_speculative_tokens` per row (a token tree: its whole size) and learns
nothing. `AdaptiveLengths` asks the adaptive policy (adaptive.py): per row from its acceptance and the
measured costs, g = 0 where speculation would cost more than it saves, trees cut to the tokens that
pay; it needs the cost curves measured first (SpecEngine.calibrate) and lets a draft model catch up
lazily, only for rows about to draft.

Knows the policy's questions, nothing of models, slots or verification.
"""
from __future__ import annotations

from typing import Callable

from .adaptive import AdaptiveDraftLength
from .cost import CostModel
from .base import DraftBatch


class FixedLengths:
    needs_costs = False                 # no cost curves to measure before the first step
    drafts_lazily = False               # a draft model prefills every prompt with the target

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens

    def lengths(self, batch, lag: Callable) -> list[int]:
        """g per row; `lag(row)`: draft KV positions it must catch up on before it can draft."""
        return [self.num_tokens] * len(batch)

    def tree_size(self, batch_size: int, max_tokens: int) -> int:
        return max_tokens

    def size_trees(self, proposal: DraftBatch) -> DraftBatch:
        return proposal

    def update(self, seq, num_draft: int, num_accepted: int) -> None:
        pass

    def observe_tree(self, scores: list[float], parents: list[int], accepted: int) -> None:
        pass


class AdaptiveLengths:
    needs_costs = True

    def __init__(self, policy: AdaptiveDraftLength):
        self.policy = policy
        self.drafts_lazily = not policy.draft_is_free   # a draft model: catch up only rows about to draft

    def lengths(self, batch, lag: Callable) -> list[int]:
        return self.policy.choose(batch, [lag(s) for s in batch])

    def tree_size(self, batch_size: int, max_tokens: int) -> int:
        """A tree's size this step, or 0 where the policy would keep none of any tree (no lookup)."""
        if self.policy.tree_may_pay(batch_size, max_tokens):
            return max_tokens
        self.policy.forget_trees()
        return 0

    def size_trees(self, proposal: DraftBatch) -> DraftBatch:
        """Token trees cut to the sizes the policy keeps, chosen from each tree's plan: a sampled tree is
        sized by its one-hot twin's estimates, never by those of the tokens it drew (drafting/trees.py:
        the exactness rule)."""
        if proposal.plans is None:
            return proposal
        keep = self.policy.tree_sizes([t.probs for t in proposal.plans], [t.parents for t in proposal.plans])
        if not any(keep) and any(proposal.num_draft):
            self.policy.forget_trees()          # refused what was offered: the calibration may be too low
        return proposal.truncated(keep)

    def update(self, seq, num_draft: int, num_accepted: int) -> None:
        self.policy.update(seq, num_draft, num_accepted)

    def observe_tree(self, scores: list[float], parents: list[int], accepted: int) -> None:
        self.policy.observe_tree(scores, parents, accepted)


def draft_lengths(adaptive: bool, num_tokens: int, costs: CostModel, draft_is_free: bool):
    """The engine's draft-length policy for drafting.adaptive."""
    if not adaptive:
        return FixedLengths(num_tokens)
    return AdaptiveLengths(AdaptiveDraftLength(num_tokens, costs, draft_is_free=draft_is_free))
