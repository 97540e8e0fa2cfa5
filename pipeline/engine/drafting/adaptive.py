"""Adaptive draft length: per sequence, from its recent acceptance and the current batch size,
using measured draft and verify costs (bench/RESULTS.md, "Adaptive policy"). CostModel holds the
cost curves: measured by a short calibration (kept in the kernel cache on CPU: Engine.calibrate), rescaled
online by the observed steps.
AdaptiveDraftLength gives each sequence the draft length g that maximises its tokens per second
(g = 0, plain decoding, where speculation would cost more than it saves) and, for token trees, the
tokens of each tree to keep; each class states its model.

No torch import: calibration times the runners it is given through their own methods.
"""
from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING, Callable

from ..core.timing import interleaved
from ..core.tree import depths

if TYPE_CHECKING:
    from ..model.runner import ModelRunner


LINEAR_FROM = 64            # tokens: the fewest a cost curve is timed to (CostModel.calibrate's linear_past)


def _bucket(batch: int | None) -> int:
    """Batch sizes that share a StepFit: the power of two at or above."""
    return 1 << (batch - 1).bit_length() if batch else 0


class StepFit:
    """The verify steps observed at one batch size bucket, fitted by least squares with decayed weights:
    y = a + s x, where x is a step's tokens past one per row, per row, and y its time over the measured
    curve's time for a plain step of its rows (V(B)). The policy's choice hinges on what extra tokens
    cost at its batch size, which the calibration measures once, on a machine that others may be using
    at that moment: one start's curve read V(256) = 1.5 V(128) where steps took 1.8x, and the policy
    drafted at 128 rows where every draft token cost a token's full share of the step. The run's own
    steps correct that: wherever rows draft, the steps' token counts vary and s is observed.

    extra(x, curve) is the relative extra cost of x tokens per row: the observed s x / a and the curve's
    `curve` weighted by their precisions, the observed one's from the fit's residuals (with a floor of
    NOISE of a step's time), the curve's its value times CURVE_SD. So a fit of a few steps, or of steps
    that barely differ in tokens, moves the price little; where no row has drafted for a while
    the weights of the steps that did decay, and the curve takes over again."""

    DECAY = 0.98          # weight kept per later step of the bucket
    CURVE_SD = 0.4        # the measured curve's relative error on extra tokens' cost
    NOISE = 0.03          # least residual standard deviation of y: a step's time varies by this much
    FLOOR = 0.05          # least relative cost the curve's error is taken on, per extra token per row

    def __init__(self):
        self.n = self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.DECAY
        self.n, self.sx, self.sy = self.n * d + 1, self.sx * d + x, self.sy * d + y
        self.sxx, self.sxy, self.syy = self.sxx * d + x * x, self.sxy * d + x * y, self.syy * d + y * y

    def line(self) -> tuple[float, float, float] | None:
        """(a, s, variance of s), or None while the steps cannot say (fewer than 4, or no spread in x)."""
        if self.n < 4:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var_x = self.sxx / self.n - mx * mx
        if var_x <= 1e-12:
            return None
        cov = self.sxy / self.n - mx * my
        slope = cov / var_x
        residual = max(self.syy / self.n - my * my - slope * cov, 0.0) * self.n / (self.n - 2)
        return my - slope * mx, max(slope, 0.0), max(residual, self.NOISE ** 2) / (self.n * var_x)

    def extra(self, x: float, curve: float) -> float:
        line = self.line()
        if line is None or line[0] <= 0:
            return curve
        a, slope, var_slope = line
        observed, var_observed = slope * x / a, var_slope * (x / a) ** 2
        var_curve = (self.CURVE_SD * max(curve, self.FLOOR * x)) ** 2
        w = var_curve / (var_curve + var_observed) if var_curve + var_observed > 0 else 0.0
        return w * observed + (1.0 - w) * curve


class CostModel:
    """The model (bench/RESULTS.md, "Adaptive policy"): with per-token acceptance alpha, a round with draft
    length g emits E(g) = (1 - alpha^(g+1)) / (1 - alpha) tokens on average and costs C(g) = V(B * (g + 1))
    + g * D(B), where V(T) is the target's forward (+ verification) time for T tokens and D(B) the draft's
    time for one step over B rows (0 for n-gram lookup). Each sequence gets the g in [0, max_draft] that
    maximises E(g) / C(g); g = 0 (plain decoding) wins when speculation would cost more than it saves. V and
    D are piecewise-linear curves measured by a short calibration (CostModel.calibrate) and rescaled online
    by the ratio of observed to predicted step times; what extra tokens cost at the running batch size is
    also read from the run's own steps (StepFit)."""

    def __init__(self, ema: float = 0.1):
        self.verify_curve: list[tuple[int, float]] = []    # (tokens, seconds)
        self.draft_curve: list[tuple[int, float]] = []     # (rows, seconds per draft step)
        self.draft_prefill_s = 0.0                          # draft prefill seconds per token
        self.verify_scale = self.draft_scale = 1.0
        self.ema = ema
        self.measured = False                               # curves timed here (calibrate), not given
        self.fits: dict[int, StepFit] = {}                 # batch bucket -> its observed verify steps

    @property
    def is_calibrated(self) -> bool:
        return bool(self.verify_curve)

    @staticmethod
    def monotone(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
        """The closest non-decreasing curve (least squares, pool-adjacent-violators): a forward over
        more tokens or rows never takes less time, and a noisy point that says otherwise (one Qwen
        calibration had V(2) > V(5)) would make the policy prefer or avoid a length for no reason."""
        blocks: list[list[float]] = []                    # [mean, count]
        for _, y in curve:
            blocks.append([y, 1.0])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
                blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
        ys = [m for m, n in blocks for _ in range(int(n))]
        return [(x, y) for (x, _), y in zip(curve, ys)]

    @staticmethod
    def _interp(curve: list[tuple[int, float]], x: float) -> float:
        if not curve:
            return 0.0
        xs = [p[0] for p in curve]
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return curve[0][1]
        if i == len(curve):       # extrapolate linearly from the last two points
            (x0, y0), (x1, y1) = curve[-2:] if len(curve) > 1 else (curve[-1], curve[-1])
        else:
            (x0, y0), (x1, y1) = curve[i - 1], curve[i]
        return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def verify_cost(self, tokens: int, batch: int | None = None) -> float:
        """A verify step of `tokens` tokens; over `batch` rows, the extra tokens past one per row are
        priced by this batch size's observed steps where they say enough (StepFit), by the curve where not."""
        fit = self.fits.get(_bucket(batch)) if batch and tokens > batch else None
        if fit is None:
            return self.verify_scale * self._interp(self.verify_curve, tokens)
        base = self._interp(self.verify_curve, batch)
        curve_extra = self._interp(self.verify_curve, tokens) / base - 1.0 if base > 0 else 0.0
        return self.verify_scale * base * (1.0 + fit.extra((tokens - batch) / batch, curve_extra))

    def draft_cost(self, rows: int) -> float:
        return self.draft_scale * self._interp(self.draft_curve, rows)

    def observe(self, batch_size: int, num_draft: int, draft_s: float, target_tokens: int,
                verify_s: float, draft_steps: int = 0) -> None:
        """Rescale the curves by observed / predicted time (exponential moving average), and, where the
        curves were measured here, add the step to its batch size's StepFit."""
        if not self.is_calibrated:
            return
        predicted = self._interp(self.verify_curve, target_tokens)
        if predicted > 0:
            self.verify_scale += self.ema * (verify_s / predicted - self.verify_scale)
        base = self._interp(self.verify_curve, batch_size)
        if self.measured and self.ema > 0 and batch_size and base > 0:
            self.fits.setdefault(_bucket(batch_size), StepFit()).add(
                (target_tokens - batch_size) / batch_size, verify_s / base)
        predicted = draft_steps * self._interp(self.draft_curve, batch_size)
        if draft_steps and predicted > 0:
            self.draft_scale += self.ema * (draft_s / predicted - self.draft_scale)

    def round_cost(self, batch_size: int, g: int, draft_is_free: bool = False) -> float:
        """A step of batch_size sequences all drafting g tokens (V + g D)."""
        draft = 0.0 if draft_is_free else g * self.draft_cost(batch_size)
        return self.verify_cost(batch_size * (g + 1), batch_size) + draft

    def catch_up_cost(self, lag: int) -> float:
        return self.draft_scale * self.draft_prefill_s * lag

    def calibrate(self, target: ModelRunner, draft: ModelRunner | None, num_slots: int, max_draft: int,
                  context: int, repeats: int = 3, clock: Callable[[], float] = time.perf_counter,
                  linear_past: int | None = None, known: dict[int, float] | None = None) -> None:
        """Measure the target's forward time per number of tokens and the draft's per number of rows
        (the cost curves), at a typical `context` length: attention reads grow with it, and a curve
        measured at context 0 underprices extra query tokens. Every forward of a model is timed once per
        round, the rounds in turn (time_forwards): a stretch where the machine is busy elsewhere slows one
        measurement of each size, not every measurement of one size, and a curve bent by such a stretch
        (a V(128) near V(256)) would make drafting look almost free. Writes scratch KV into the runners'
        first slots: only while no sequence holds a slot.
        linear_past: where the target's forward is bound by its arithmetic past that many tokens (a CPU
        past twice its slots: one fp32 start at 128 slots read 1.94 ms per token from 128 to 256 tokens
        and 1.88 from 256 to 640), no size past it (nor past LINEAR_FROM) is timed, and the curve runs on
        along the line through its last two points (`_interp`); the run's steps correct it (StepFit).
        The largest sizes took three quarters of that start's 13.6 s of measuring. (Engine.calibrate
        also takes it where the line is an upper bound.)
        known: seconds of forwards of one token per row at `context` already timed the same way, by rows
        (the runner's plain steps, measured to fit its slots: ModelRunner.plain_steps); a size of the
        curve up to the slots that is among them is taken from them, not timed again."""
        max_tokens = num_slots * (max_draft + 1)
        if linear_past is not None:
            max_tokens = min(max_tokens, max(linear_past, LINEAR_FROM))
        sizes = sorted({min(2 ** i, max_tokens) for i in range(max_tokens.bit_length() + 1)} | {max_tokens})
        seconds = {t: s for t, s in (known or {}).items() if t in sizes and t <= num_slots}
        timed = [t for t in sizes if t not in seconds]
        seconds.update(zip(timed, time_forwards(target, [(t, num_slots, "all") for t in timed], context, repeats,
                                                clock)))
        self.verify_curve = CostModel.monotone([(t, seconds[t]) for t in sizes])
        self.measured, self.fits = True, {}
        if draft is None:
            return
        rows = sorted({min(2 ** i, num_slots) for i in range(num_slots.bit_length() + 1)})
        chunk = min(64, context)          # the lazy catch-up's prefill, per token (no logits)
        times = time_forwards(draft, [(r, r, "all") for r in rows] + [(chunk, 1, "none")], context, repeats, clock)
        self.draft_curve = CostModel.monotone(list(zip(rows, times)))
        self.draft_prefill_s = times[-1] / chunk

    def curves(self) -> dict:
        """The measured curves, as JSON (the kernel cache keeps them: Engine.calibrate)."""
        return {"verify": self.verify_curve, "draft": self.draft_curve, "draft_prefill_s": self.draft_prefill_s}

    def use(self, curves: dict) -> None:
        """Take curves measured on this machine before (curves()), as if calibrate had just measured them."""
        self.verify_curve = [(int(t), float(s)) for t, s in curves["verify"]]
        self.draft_curve = [(int(r), float(s)) for r, s in curves["draft"]]
        self.draft_prefill_s = float(curves["draft_prefill_s"])
        self.measured, self.fits = True, {}


def time_forwards(runner: ModelRunner, forwards: list[tuple[int, int, str]], context: int, repeats: int,
                  clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Median seconds of each forward (tokens, at most rows, logits) at `context`, + the softmax the engine
    applies to its logits: a warm-up round, then `repeats` rounds each timing every forward once."""
    calls = [lambda t=t, r=r, lg=lg: _forward(runner, t, r, context, lg) for t, r, lg in forwards]
    return interleaved(calls, repeats, clock=clock)


def _forward(runner: ModelRunner, tokens: int, max_rows: int, context: int, logits: str) -> None:
    """One forward of `tokens` tokens over at most `max_rows` rows (scratch KV in the first slots)."""
    rows = min(tokens, max_rows)
    per_row = -(-tokens // rows)
    context = min(context, runner.cache.max_len - per_row)
    out = runner.forward(list(range(rows)), [context] * rows, [[0] * per_row for _ in range(rows)], logits=logits)
    if out is not None:
        out.softmax(dim=-1)
    runner.synchronize()


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
