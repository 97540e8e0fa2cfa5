"""The draft and verify costs the adaptive policy prices rounds with (bench/RESULTS.md, "Adaptive policy").

CostModel holds the cost curves: V(T), the target's forward (+ verification) over T tokens, and D(B),
the draft model's step over B rows, measured by a short calibration (kept in the kernel cache on CPU:
Engine.calibrate) and rescaled online by the observed steps; what extra tokens cost at the running
batch size is also read from the run's own steps (StepFit).

Knows what steps cost, nothing of acceptance or of which length a row drafts (adaptive.py). No torch
import: calibration times the runners it is given through their own methods.
"""
from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING, Callable

from ..core.timing import interleaved

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

