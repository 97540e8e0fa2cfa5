"""Adaptive draft length: per sequence, from its recent acceptance and the current batch size,
using measured draft and verify costs (bench/RESULTS.md, "Adaptive policy"). The costs are
CostModel's (cost.py): curves measured by a short calibration, rescaled online by the observed steps.
AdaptiveDraftLength gives each sequence the draft length g that maximises its tokens per second
(g = 0, plain decoding, where speculation would cost more than it saves) and, for token trees, the
tokens of each tree to keep; each class states its model.

Knows acceptance and the rates it buys; what a step costs it asks the CostModel. No torch import.
"""
from __future__ import annotations

from ..core.tree import depths
from .cost import CostModel


def expected_tokens(alpha: float, g: int) -> float:
    """Mean tokens emitted by a round with draft length g and per-token acceptance alpha."""
    if alpha >= 1.0:
        return g + 1.0
    return (1.0 - alpha ** (g + 1)) / (1.0 - alpha)


TREE_PRIOR = 0.5            # trees: accepted share of the index's estimate before any tree round
GAIN = 1.0001               # a rate beats another only by more than this factor (not by rounding)
TREE_PRIOR_WEIGHT = 2.0     # the prior's weight, in estimated tokens
TREE_FORGET = 0.98          # per refused step: the calibration's evidence kept (forget_trees)


class AdaptiveDraftLength:
    """Acceptance is estimated per sequence from decayed counts of accepted drafts and first rejections
    (geometric model), with a weak prior so a sequence that fell to g = 0 is retried later. With a draft
    model the prior is the engine-wide acceptance once observed, and drafting must then beat g = 0 by a
    margin (10%): a curve calibrated on shared cores is noisy by about that much. Until then, if no sequence
    would draft but a good draft (acceptance `explore_alpha`) would pay, one sequence drafts anyway:
    otherwise a pessimistic prior or a noisy calibration would keep g = 0 forever, and the acceptance that
    would correct it is never observed. A sequence whose draft KV lags its history (a new prompt, or a
    stretch at g = 0) must first be caught up (a draft prefill of `lag` tokens, P per token): it drafts only
    if the time drafting saves over its remaining tokens R, R * (C(0) - C(g) / E(g)) / B, exceeds lag * P.
    The lag comes from the drafter, which owns the draft KV (Drafter.catch_up_lag); the policy only reads
    it."""

    def __init__(self, max_draft: int, costs: CostModel, draft_is_free: bool = False,
                 prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9, draft_margin: float = 0.1,
                 evidence_tokens: int = 16, explore_alpha: float = 0.9):
        self.max_draft, self.costs, self.draft_is_free = max_draft, costs, draft_is_free
        self.draft_margin, self.evidence_tokens, self.explore_alpha = draft_margin, evidence_tokens, explore_alpha
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self._stats: dict[str, list[float]] = {}       # request id -> [accepted, rejections] (decayed)
        self._engine_stats = [0.0, 0.0]                # all sequences: [accepted, rejections] (decayed)
        self._drafted = 0                              # draft tokens verified, all time
        self.tree_prior = TREE_PRIOR
        self._tree_depths: list[list[float]] = []      # trees, per depth d - 1: [rounds accepting >= d, estimated]

    @property
    def has_evidence(self) -> bool:
        """A draft model's acceptance has been observed on enough tokens to act on it."""
        return not self.draft_is_free and self._drafted >= self.evidence_tokens

    def _prior(self) -> float:
        """A draft model's engine-wide acceptance once observed (new sequences start from it);
        the fixed prior before that, and always for n-gram lookup (its acceptance is per prompt)."""
        if not self.has_evidence:
            return self.prior
        acc, rej = self._engine_stats
        return (acc + self.prior) / (acc + rej + 1.0)

    def acceptance(self, request_id: str) -> float:
        acc, rej = self._stats.get(request_id, (0.0, 0.0))
        return (acc + self._prior() * self.prior_weight) / (acc + rej + self.prior_weight)

    def update(self, seq, num_draft: int, num_accepted: int) -> None:
        rejected = 1.0 if num_accepted < num_draft else 0.0
        for stats, decay in ((self._stats.setdefault(seq.request_id, [0.0, 0.0]), self.decay),
                             (self._engine_stats, 0.99)):
            stats[0] = stats[0] * decay + num_accepted
            stats[1] = stats[1] * decay + rejected
        self._drafted += num_draft
        if seq.is_finished:
            del self._stats[seq.request_id]

    def round_costs(self, batch_size: int) -> list[float]:
        """C(g) for g = 0 .. max_draft at this batch size: the same for every sequence of a step."""
        return [self.costs.round_cost(batch_size, g, self.draft_is_free) for g in range(self.max_draft + 1)]

    def best_length(self, alpha: float, batch_size: int, margin: float | None = None, min_g: int = 0,
                    costs: list[float] | None = None) -> int:
        """The g maximising tokens per second. With a draft model, drafting must beat g = 0 by
        `margin` (default draft_margin): the calibration is noisy, so a predicted gain of a few
        percent can be a measured loss. `min_g`: the best length of at least that. `costs`: the step's
        round_costs, where the caller has them."""
        margin = self.draft_margin if margin is None else margin
        costs = costs or self.round_costs(batch_size)
        best_g, best_rate = min_g, 0.0
        for g in range(min_g, self.max_draft + 1):
            cost = costs[g]
            rate = expected_tokens(alpha, g) / cost if cost > 0 else 0.0
            if g > 0 and not self.draft_is_free:
                rate /= 1.0 + margin
            if rate > best_rate * GAIN:
                best_g, best_rate = g, rate
        return best_g

    def _tree_factor(self, cal: list[float], d: int) -> float:
        """c_d from tree_calibration `cal`: deeper than observed, the deepest observed (the prior before any)."""
        return cal[d - 1] if d <= len(cal) else (cal[-1] if cal else self.tree_prior)

    @property
    def tree_calibration(self) -> list[float]:
        """c_d per depth d (index d - 1): accepted share of the estimate (tree_sizes)."""
        out, prior = [], self.tree_prior
        for accepted, estimated in self._tree_depths:
            share = (accepted + TREE_PRIOR_WEIGHT * prior) / (estimated + TREE_PRIOR_WEIGHT)
            prior = share if not out else min(out[-1], share)
            out.append(prior)
        return out

    def observe_tree(self, scores: list[float], parents: list[int], accepted: int, decay: float = 0.98) -> None:
        """One row's round: its tree's estimates (by depth) against the depth it accepted. A row that
        drafted nothing says nothing about the estimates."""
        if not parents:
            return
        row_depths = depths(parents)
        per_depth = [0.0] * max(row_depths)
        for score, d in zip(scores, row_depths):
            per_depth[d - 1] += score
        self._tree_depths += [[0.0, 0.0] for _ in range(len(per_depth) - len(self._tree_depths))]
        for d, stats in enumerate(self._tree_depths, start=1):
            stats[0] = stats[0] * decay + (accepted >= d)
            stats[1] = stats[1] * decay + (per_depth[d - 1] if d <= len(per_depth) else 0.0)

    def forget_trees(self, decay: float = TREE_FORGET) -> None:
        """A step whose trees the policy refused: the evidence behind each c_d decays, so c_d drifts
        back towards its prior. Once it pays again at this batch size the trees are retried, and rounds
        that still accept too little refuse them again within a few steps (the evidence is light then);
        where even the prior cannot pay (tree_may_pay's bound at c_1 = the prior) nothing is retried."""
        for stats in self._tree_depths:
            stats[0] *= decay
            stats[1] *= decay

    def tree_may_pay(self, batch_size: int, max_tokens: int) -> bool:
        """Whether any trees of at most `max_tokens` tokens per row could raise a step's rate at this
        batch size. Every token's value c_d s is at most c_1 (s <= 1, c_d non-increasing), so where m
        tokens worth c_1 each never pay, tree_sizes keeps nothing whatever the drafter finds, and the
        engine skips the lookup. The bound's rate (B + m c_1) / V(B + m) is monotone between the verify
        curve's points (V is linear there), so its points and the largest m are the only ones to test."""
        if not self.costs.is_calibrated or not batch_size:
            return True
        value, most = self._tree_factor(self.tree_calibration, 1), batch_size * max_tokens
        rate = lambda m: (batch_size + m * value) / self.costs.verify_cost(batch_size + m, batch_size)
        ends = {x - batch_size for x, _ in self.costs.verify_curve if 0 < x - batch_size < most} | {most}
        return any(rate(m) > rate(0) * GAIN for m in ends)

    def tree_sizes(self, scores: list[list[float]], parents: list[list[int]]) -> list[int]:
        """Tokens to keep of each row's tree; rows listed best-first.

        Token trees (drafting.tree): the drafter grows each row's tree up to its size and lists its tokens
        best-first with an estimated path probability s (drafting/trees.py); the policy keeps, over the
        whole batch, the m likeliest tokens that maximise (B + sum c_d s) / V(B + m), where d is a token's
        depth and c_d the observed share of the estimate at that depth: the rounds that accepted at least d
        tokens over the estimates summed at depth d (decayed sums; depth 1's prior TREE_PRIOR for
        TREE_PRIOR_WEIGHT estimated tokens, each deeper depth's prior the depth above's c, and c_d never
        above c_(d-1)). Rounds that accept what the index estimated raise c_1 towards 1, past the prior. An
        index's estimate is confident where it saw a continuation once (a one-occurrence chain estimates 1
        at every depth), and the truth falls off with depth; c_d learns how fast. The policy may keep a
        tree, a path or nothing. Where no tree could pay at the step's batch size, even one whose every
        token were worth c_1, the drafter is not asked at all (tree_may_pay): a large batch pays no lookups
        it would discard. A step whose trees the policy refuses (no lookup, or no token kept of what the
        drafter offered) decays the calibration's evidence towards the prior (forget_trees), as a sequence's
        acceptance decays in its rounds at g = 0: a calibration that fell below what pays is otherwise never
        observed again, and one poor stretch of rounds, or a noisy verify curve, would keep trees off for
        the rest of the run."""
        batch = len(scores)
        if not self.costs.is_calibrated or not batch:
            return [len(s) for s in scores]
        cal = self.tree_calibration
        ranked = sorted(((self._tree_factor(cal, d) * s, b, i) for b, (row, ps) in enumerate(zip(scores, parents))
                         for i, (s, d) in enumerate(zip(row, depths(ps)))), key=lambda t: (-t[0], t[1], t[2]))
        best_m, best_rate, expected = 0, batch / self.costs.verify_cost(batch, batch), float(batch)
        for m, (value, _, _) in enumerate(ranked, start=1):
            expected += value
            rate = expected / self.costs.verify_cost(batch + m, batch)
            if rate > best_rate * GAIN:
                best_m, best_rate = m, rate
        keep = [0] * batch
        for _, b, _ in ranked[:best_m]:
            keep[b] += 1
        return keep

    def catch_up_pays(self, alpha: float, g: int, batch_size: int, lag: int, remaining: int) -> bool:
        """Whether building `lag` positions of draft KV pays for itself over `remaining` tokens: per
        emitted token a step of B sequences at g costs C(g) / (B E(g)) instead of C(0) / B. The
        remaining count is max_tokens' bound (an EOS may come sooner), so this errs towards drafting."""
        c0, cg = self.costs.round_cost(batch_size, 0), self.costs.round_cost(batch_size, g)
        saved = remaining * (c0 - cg / expected_tokens(alpha, g)) / batch_size
        return saved > self.costs.catch_up_cost(lag)

    def choose(self, batch, lags: list[int] | None = None) -> list[int]:
        """g per sequence. `lags[b]`: draft KV positions sequence b must catch up on before it can
        draft (the drafter's catch_up_lag; None: none lags)."""
        if not self.costs.is_calibrated:
            return [self.max_draft] * len(batch)
        # Until a draft model's acceptance is known, no margin: drafting is how it becomes known.
        margin = None if self.has_evidence else 0.0
        costs = self.round_costs(len(batch))
        lengths = []
        for s, lag in zip(batch, lags or [0] * len(batch)):
            alpha = self.acceptance(s.request_id)
            g = self.best_length(alpha, len(batch), margin, costs=costs)
            if g and not self.draft_is_free and lag and not self.catch_up_pays(
                    alpha, g, len(batch), lag, s.params.max_tokens - len(s.output_ids)):
                g = 0
            lengths.append(g)
        if (batch and not any(lengths) and not self.draft_is_free and not self.has_evidence
                and self.best_length(self.explore_alpha, len(batch), 0.0) > 0):
            # Explore: the oldest sequence drafts (its draft KV is caught up once) until the draft's
            # acceptance is known; bounded by evidence_tokens draft tokens per engine.
            lengths[0] = self.best_length(self.acceptance(batch[0].request_id), len(batch), 0.0, min_g=1)
        return lengths
