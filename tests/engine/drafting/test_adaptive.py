"""Adaptive draft length: the policy's choices follow its cost model, a sequence that fell to g = 0 is
retried, and the adaptive engine stays lossless, prefilling the draft model only for sequences about
to draft (lazy catch-up, within the prefill budget)."""
from __future__ import annotations

import pytest
import torch

from conftest import dynamic_cache_keys, greedy_reference, make_engine, mixed_prompts, run_requests
from pipeline.engine import SamplingParams
from pipeline.engine.backends.cpu import calibrate as cal
from pipeline.engine.drafting.adaptive import AdaptiveDraftLength, expected_tokens
from pipeline.engine.drafting.cost import CostModel, StepFit
from pipeline.engine.drafting.draft_model import draft_lag
from pipeline.engine.core.request import Sequence


def costs(verify: list[tuple[int, float]], draft: list[tuple[int, float]]) -> CostModel:
    cm = CostModel()
    cm.verify_curve, cm.draft_curve = verify, draft
    return cm


FLAT_VERIFY = [(1, 1.0), (10_000, 1.0)]          # verifying more tokens costs nothing extra
LINEAR_VERIFY = [(1, 1.0), (10_000, 10_000.0)]   # every token costs a full forward
CHEAP_DRAFT, COSTLY_DRAFT = [(1, 1e-6), (64, 1e-6)], [(1, 1e3), (64, 1e3)]


def test_expected_tokens_is_the_geometric_mean_length():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_policy_drafts_when_verification_is_cheap_and_not_when_it_is_not():
    assert AdaptiveDraftLength(4, costs(FLAT_VERIFY, CHEAP_DRAFT)).best_length(0.5, batch_size=8) == 4
    # every verified token costs a forward: speculation can only lose, at any acceptance below 1
    assert AdaptiveDraftLength(4, costs(LINEAR_VERIFY, CHEAP_DRAFT)).best_length(0.9, batch_size=8) == 0
    # a free verifier but a draft step costing 1000 target forwards
    assert AdaptiveDraftLength(4, costs(FLAT_VERIFY, COSTLY_DRAFT)).best_length(0.9, batch_size=1) == 0
    # an n-gram drafter is free whatever the draft curve says
    assert AdaptiveDraftLength(4, costs(FLAT_VERIFY, COSTLY_DRAFT), draft_is_free=True).best_length(0.9, 1) == 4


def test_draft_model_must_beat_plain_decoding_by_the_margin():
    # verify flat, draft step 0.15 of a forward: at alpha 0.2, g = 1 predicts 1.2 / 1.15 = +4%
    cm = costs(FLAT_VERIFY, [(1, 0.15)])
    assert AdaptiveDraftLength(4, cm, draft_margin=0.0).best_length(0.2, 1) == 1
    assert AdaptiveDraftLength(4, cm, draft_margin=0.1).best_length(0.2, 1) == 0
    assert AdaptiveDraftLength(4, cm, draft_margin=0.1, draft_is_free=True).best_length(0.2, 1) > 0
    assert AdaptiveDraftLength(4, cm, draft_margin=0.1).best_length(0.8, 1) > 0     # a clear gain drafts


def test_policy_length_grows_with_acceptance():
    # verify cost grows mildly with tokens: a short draft pays at low acceptance, a long one at high
    policy = AdaptiveDraftLength(8, costs([(1, 1.0), (9, 1.6)], [(1, 0.05)]))
    lengths = [policy.best_length(a, batch_size=1) for a in (0.05, 0.3, 0.6, 0.9)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_sequence_that_fell_to_zero_is_retried():
    policy = AdaptiveDraftLength(4, costs([(1, 1.0), (5, 1.3)], [(1, 0.1)]))
    good = Sequence("good", [1, 2, 3], SamplingParams(max_tokens=1000), 0)
    bad = Sequence("bad", [1, 2, 3], SamplingParams(max_tokens=1000), 0)
    assert policy.choose([bad])[0] > 0                                       # no evidence yet: explore
    for _ in range(20):         # the draft model is good on most sequences, useless on this one
        policy.update(good, 4, 4)
        policy.update(bad, max(policy.choose([bad])[0], 1), 0)
    assert policy.has_evidence and policy.choose([good])[0] > 0
    assert policy.choose([bad]) == [0]
    for rounds_at_zero in range(1, 100):                                     # rounds without drafts
        policy.update(bad, 0, 0)
        if policy.choose([bad])[0] > 0:
            break
    else:
        pytest.fail("a sequence at g = 0 must drift back to the engine-wide prior and draft again")
    assert rounds_at_zero > 1


def test_new_sequences_start_from_the_observed_acceptance():
    cm = costs([(1, 1.0), (2, 1.05), (3, 1.1)], [(1, 0.3)])
    policy = AdaptiveDraftLength(2, cm)
    old = Sequence("old", [1], SamplingParams(max_tokens=1000), 0)
    for _ in range(30):
        policy.update(old, 2, 0)                                             # every draft rejected
    assert policy.acceptance("new") < 0.1
    assert policy.choose([Sequence("new", [1], SamplingParams(max_tokens=1000), 0)]) == [0]


def test_calibration_curves_are_made_non_decreasing():
    noisy = [(1, 1.0), (2, 3.0), (4, 2.0), (8, 5.0), (16, 4.0), (32, 4.5)]
    fitted = CostModel.monotone(noisy)
    assert [x for x, _ in fitted] == [x for x, _ in noisy]
    assert [y for _, y in fitted] == pytest.approx([1.0, 2.5, 2.5, 4.5, 4.5, 4.5])
    assert sum(y for _, y in fitted) == pytest.approx(sum(y for _, y in noisy))   # least squares keeps the mean
    clean = [(1, 1.0), (2, 1.1), (4, 1.3)]
    assert CostModel.monotone(clean) == clean


class _ClockedRunner:
    """A runner whose forward advances a fake clock by 1 ms per token, 3 ms per token while the machine
    is busy elsewhere: forwards number `busy` (in call order, warm-ups included) run in such a stretch."""

    def __init__(self, busy: range):
        self.now, self.calls, self.busy = 0.0, 0, busy
        self.cache = type("Cache", (), {"max_len": 1024})()

    def forward(self, slots, starts, tokens, logits="all"):
        self.now += sum(map(len, tokens)) * (3e-3 if self.calls in self.busy else 1e-3)
        self.calls += 1
        return None

    def synchronize(self):
        pass


def test_calibration_times_every_size_in_turn_so_a_busy_stretch_bends_no_point():
    """A stretch of 3 consecutive forwards at triple cost (another process on the cores) comes after the
    warm-up round: taken size by size it would fall on the 3 timings of one size (V(128) near V(256):
    drafting would look almost free at 128 rows); in turn it slows one timing of 3 sizes, and medians
    keep every point exact."""
    for start in range(12, 30):        # the warm-up round is 11 forwards (sizes 1 .. 640 at 128 rows x 5)
        runner = _ClockedRunner(range(start, start + 3))
        cm = CostModel()
        cm.calibrate(runner, None, num_slots=128, max_draft=4, context=384, repeats=3,
                     clock=lambda: runner.now)
        assert cm.verify_curve == [(t, pytest.approx(t * 1e-3)) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 640)]
        assert runner.calls == 4 * 11



def test_past_a_forward_bound_by_its_arithmetic_the_curve_is_extrapolated_not_timed():
    """linear_past 256 at 128 slots x 5 tokens: sizes 1 .. 256 timed (9 forwards a round), 512 and 640
    priced along the line through 128 and 256 (here exact: 1 ms per token). At one slot x 5 tokens the
    curve is timed to the end: LINEAR_FROM (64) is above it."""
    runner = _ClockedRunner(range(0))
    cm = CostModel()
    cm.calibrate(runner, None, num_slots=128, max_draft=4, context=384, repeats=3,
                 clock=lambda: runner.now, linear_past=256)
    assert [t for t, _ in cm.verify_curve] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert runner.calls == 4 * 9
    assert cm.verify_cost(640) == pytest.approx(0.640) and cm.verify_cost(512) == pytest.approx(0.512)
    small = CostModel()
    small.calibrate(runner, None, num_slots=1, max_draft=4, context=384, repeats=3,
                    clock=lambda: runner.now, linear_past=2)
    assert [t for t, _ in small.verify_curve] == [1, 2, 4, 5]

def test_sizes_among_the_known_plain_steps_are_taken_not_timed():
    """The runner's plain steps up to its 128 slots (rows -> s, here 2 ms per row, unlike the clock's
    1 ms per token, so a timed size would show): with linear_past at the slots nothing is timed, the
    curve is those steps and runs on along the last two past them. At 32 slots the curve still reaches
    LINEAR_FROM (64 tokens): that one size is timed (a warm-up and 3 rounds), the rest taken."""
    steps = {r: 2e-3 * r for r in (1, 2, 4, 8, 16, 32, 64, 128, 192)}
    runner = _ClockedRunner(range(0))
    cm = CostModel()
    cm.calibrate(runner, None, num_slots=128, max_draft=4, context=384, repeats=3,
                 clock=lambda: runner.now, linear_past=128, known=steps)
    assert runner.calls == 0
    assert cm.verify_curve == [(t, 2e-3 * t) for t in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert cm.verify_cost(640) == pytest.approx(1.28)
    few = CostModel()
    few.calibrate(runner, None, num_slots=32, max_draft=4, context=384, repeats=3,
                  clock=lambda: runner.now, linear_past=32, known={r: s for r, s in steps.items() if r <= 32})
    assert runner.calls == 4
    assert few.verify_curve == [(t, 2e-3 * t) for t in (1, 2, 4, 8, 16, 32)] + [(64, pytest.approx(64e-3))]


# A calibration bent by a busy stretch: extra tokens look cheap at 128 rows (V(256) = 1.5 V(128)),
# where the machine's steps are compute-bound and every token costs its full share (V(T) ~ T).
BENT_VERIFY = [(1, 0.02), (64, 0.08), (128, 0.14), (256, 0.21), (512, 0.56), (640, 0.70)]


def _measured(curve):
    cm = costs(curve, [])
    cm.measured = True
    return cm


def test_observed_steps_price_extra_tokens_where_the_calibration_was_bent():
    """At 75% acceptance a row drafting 1 token emits 1.75 tokens for 2 tokens' work: on the bent curve
    that pays (the policy drafts), on the machine it does not. After the steps of a few rounds with some
    rows drafting, the fitted price says so and the policy stops; batch sizes whose steps were not
    observed keep the curve."""
    cm = _measured(BENT_VERIFY)
    policy = AdaptiveDraftLength(4, cm, draft_is_free=True)
    assert policy.best_length(0.75, 128) > 0
    for i in range(30):
        extra = 16 * (1 + i % 4)                          # 16 .. 64 draft tokens over 128 rows
        cm.observe(128, extra, 0.0, 128 + extra, 0.14 * (1 + extra / 128))
    assert policy.best_length(0.75, 128) == 0
    assert cm.verify_cost(256, 128) == pytest.approx(2 * cm.verify_cost(128, 128), rel=0.05)
    assert cm.verify_cost(128, 64) == cm.verify_cost(128)         # another bucket: the curve's


def test_steps_without_drafts_or_with_given_curves_leave_the_curve_as_it_is():
    cm = _measured(BENT_VERIFY)
    for _ in range(30):
        cm.observe(128, 0, 0.0, 128, 0.14)              # no row drafted: no spread in tokens, nothing to fit
    assert cm.verify_cost(256, 128) == pytest.approx(cm.verify_cost(256))
    for given in (costs(BENT_VERIFY, []), _measured(BENT_VERIFY)):   # curves set by hand; rescaling off
        given.ema = 0.0 if given.measured else given.ema
        for i in range(30):
            given.observe(128, 16 * (1 + i % 4), 0.0, 128 + 16 * (1 + i % 4), 0.14 * (1 + (1 + i % 4) / 8))
        assert not given.fits and given.verify_cost(256, 128) == pytest.approx(given.verify_cost(256))


def test_a_few_noisy_steps_move_the_price_little():
    """Four steps whose times scatter by 20% say little about the slope: the price stays near the
    curve's, where thirty steps of the same scatter pull it most of the way to what they show."""
    curve_extra, true_extra = 0.5, 1.0                   # at x = 1 extra token per row
    fit = StepFit()
    scatter = [1.2, 0.8, 0.8, 1.2]
    for i in range(4):
        x = 0.125 * (1 + i)
        fit.add(x, (1 + true_extra * x) * scatter[i])
    few = fit.extra(1.0, curve_extra)
    for i in range(30):
        x = 0.125 * (1 + i % 4)
        fit.add(x, (1 + true_extra * x) * (1.02 if i % 2 else 0.98))
    many = fit.extra(1.0, curve_extra)
    assert abs(few - curve_extra) < 0.25 * abs(true_extra - curve_extra)
    assert abs(many - true_extra) < 0.25 * abs(true_extra - curve_extra)


# Draft step = half a forward: at the prior acceptance (0.5) no length pays, at 0.9 g = 1 would.
HALF_FORWARD_DRAFT = [(1, 0.5), (64, 0.5)]
MILD_VERIFY = [(1, 1.0), (5, 1.3), (10_000, 2_500.0)]


def test_an_unknown_draft_is_explored_by_one_sequence_until_its_acceptance_is_known():
    policy = AdaptiveDraftLength(4, costs(MILD_VERIFY, HALF_FORWARD_DRAFT))
    assert policy.best_length(0.5, 1) == 0 and policy.best_length(0.9, 1) > 0
    seqs = [Sequence(str(i), [1, 2], SamplingParams(max_tokens=1000), 0) for i in range(3)]
    lengths = policy.choose(seqs[:1])
    assert lengths[0] >= 1                              # alone and unknown: it explores
    # at batch 3 the same curves (verify ~ tokens beyond 5) still reward a good draft: one explores
    lengths = policy.choose(seqs)
    assert lengths[0] >= 1 and lengths[1:] == [0, 0]
    while not policy.has_evidence:                      # the draft turns out good
        policy.update(seqs[0], lengths[0], lengths[0])
    assert all(g > 0 for g in policy.choose(seqs[:1]))  # engine-wide acceptance now says: draft
    bad = AdaptiveDraftLength(4, costs(MILD_VERIFY, HALF_FORWARD_DRAFT))
    while not bad.has_evidence:                         # the draft turns out useless
        bad.update(seqs[0], 2, 0)
    assert bad.choose(seqs) == [0, 0, 0]                # evidence ends exploration
    # nothing to learn: even a 0.9 acceptance could not pay for these costs
    assert AdaptiveDraftLength(4, costs(LINEAR_VERIFY, COSTLY_DRAFT)).choose(seqs) == [0, 0, 0]


def test_a_lagging_draft_kv_is_caught_up_only_where_drafting_pays_it_back():
    """Qwen at batch 4: drafting was predicted to pay, but building three prompts' draft KV (5.9 s)
    cost more than the few rounds left could save. Here: V flat, D = 0.1, prefill 0.01 s/token."""
    cm = costs(FLAT_VERIFY, [(1, 0.1), (64, 0.1)])
    cm.draft_prefill_s = 0.01
    policy = AdaptiveDraftLength(4, cm)
    alpha, g = 0.8, policy.best_length(0.8, 4)
    # one round at g saves C(0) - C(g) / E(g) = 1 - (1 + 0.1 g) / E(g) per token, shared by 4 rows
    saved_per_token = (1.0 - (1.0 + 0.1 * g) / expected_tokens(alpha, g)) / 4
    assert g > 0 and saved_per_token > 0
    lag = 200                                          # 2 s of catch-up
    breakeven = 2.0 / saved_per_token
    assert not policy.catch_up_pays(alpha, g, 4, lag, remaining=int(breakeven * 0.9))
    assert policy.catch_up_pays(alpha, g, 4, lag, remaining=int(breakeven * 1.1) + 1)

    def seq(rid, prompt_len, max_tokens):
        return Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0)
    while not policy.has_evidence:                     # a good draft, known
        policy.update(seq("x", 1, 1000), 4, 4)
    short = seq("short", 201, 4)                       # 200 positions behind, 4 tokens left
    long = seq("long", 201, 1000)                      # 200 behind, up to 1000 tokens left
    warm = seq("warm", 201, 4)                         # caught up: nothing to pay
    batch, draft_computed = [short, long, warm, seq("w2", 201, 4)], [0, 0, 200, 200]
    lags = [draft_lag(s.num_tokens, c) for s, c in zip(batch, draft_computed)]   # what the drafter reports
    assert lags == [200, 200, 0, 0]
    lengths = policy.choose(batch, lags)
    assert lengths[0] == 0 and lengths[1] > 0 and lengths[2] > 0
    cm.draft_prefill_s = 0.0                           # without a measured prefill cost: no gate
    assert policy.choose([short], lags[:1])[0] > 0


def _force(engine, verify, draft):
    """Fix the engine's cost curves (skips calibration) and turn off their online rescaling, which
    would pull them towards this machine's measured step times and make the policy timing-dependent
    (a run that never drafted made these tests flaky)."""
    engine.costs.verify_curve, engine.costs.draft_curve = list(verify), list(draft)
    engine.costs.ema = 0.0


@pytest.mark.parametrize("kind", ["draft-greedy", "hybrid", "ngram"])
def test_adaptive_engine_is_lossless_and_drafts_lazily(target_model, draft_model, kind):
    engine = make_engine(target_model, kind, draft_model, max_num_seqs=4, max_model_len=128, g=4,
                         adaptive=True, max_prefill_tokens=24)
    _force(engine, FLAT_VERIFY, CHEAP_DRAFT)
    prompts = mixed_prompts(16, target_model.config.vocab_size, seed=21)
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=16, temperature=0), arrive_every=2)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, prompt, 16), f"prompt {i}"
    assert sum(r.accepted for r in rounds) > 0 and sum(r.draft_len - r.accepted for r in rounds) > 0
    runner = engine.drafter.draft_runner
    if runner is not None:   # each sequence's draft KV was built once: prompts + committed tokens, no more
        committed = sum(len(p) + len(done[str(i)].output_ids) for i, p in enumerate(prompts))
        assert 0 < runner.num_forward_tokens <= committed + sum(r.draft_len for r in rounds)


def test_adaptive_at_zero_never_runs_the_draft_model(target_model, draft_model):
    engine = make_engine(target_model, "draft-greedy", draft_model, max_num_seqs=4, max_model_len=128, g=4,
                         adaptive=True)
    _force(engine, LINEAR_VERIFY, COSTLY_DRAFT)
    prompts = mixed_prompts(8, target_model.config.vocab_size, seed=22)
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=12, temperature=0))
    assert all(r.draft_len == 0 for r in rounds)
    assert engine.drafter.runner.num_forward_tokens == 0           # not even the prompts' KV
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, prompt, 12)


def test_lazy_catch_up_builds_the_drafts_kv_exactly(target_model, draft_model):
    """Long prompts, a small prefill budget: the draft's KV is caught up over several steps (the
    sequence drafts nothing meanwhile) and then holds exactly the committed history's keys."""
    engine = make_engine(target_model, "draft-prob", draft_model, max_num_seqs=3, max_model_len=160, g=3,
                         adaptive=True, max_prefill_tokens=16)
    _force(engine, FLAT_VERIFY, CHEAP_DRAFT)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(target_model.config.vocab_size, (100,), generator=gen).tolist() for _ in range(3)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=0.8), seed=i)
    seen_drafting = 0
    while engine.has_unfinished():
        out = engine.step()
        for r in out.rounds:
            seq = next((s for s in engine.scheduler.running if s.request_id == r.request_id), None)
            if seq is None:
                continue
            assert engine.drafter.num_computed(seq) <= seq.num_tokens - 1
            if r.draft_len > 0:
                seen_drafting += 1
                n = engine.drafter.num_computed(seq)
                got = engine.drafter.runner.cache.keys[0][seq.slot, :, :n]
                torch.testing.assert_close(got, dynamic_cache_keys(draft_model, seq.all_ids()[:n]), atol=2e-4, rtol=1e-4)
    assert seen_drafting > 0


@pytest.mark.parametrize("good", [True, False])
def test_adaptive_engine_explores_a_draft_its_prior_would_never_try(target_model, draft_model, good):
    """The failure this guards against: a pessimistic calibration (prior 0.5 predicts no gain) kept
    g = 0 for a whole Qwen run although the draft's acceptance was 0.84. A perfect draft (the target
    itself) is found out by exploring and then drafts everywhere; the noisy-copy draft (acceptance
    ~0.07 here) stops once its acceptance is known, after ~evidence_tokens draft tokens."""
    engine = make_engine(target_model, "draft-greedy", target_model if good else draft_model, max_num_seqs=2,
                         max_model_len=128, g=4, adaptive=True)
    _force(engine, MILD_VERIFY, HALF_FORWARD_DRAFT)
    prompts = mixed_prompts(6, target_model.config.vocab_size, seed=23)
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=24, temperature=0))
    assert engine.lengths.policy.has_evidence
    drafted = sum(r.draft_len for r in rounds)
    if good:
        assert sum(r.accepted for r in rounds) == drafted
        late = [r for r in rounds if r.request_id in ("4", "5")]
        # everyone drafts now, but in each sequence's last round (max_tokens caps g at 0)
        assert late and sum(r.draft_len == 0 for r in late) <= 2
    else:
        assert engine.lengths.policy.evidence_tokens <= drafted <= engine.lengths.policy.evidence_tokens + 2 * 4
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, prompt, 24)


def test_the_cost_curves_are_measured_once_per_machine_models_and_slots(target_model, draft_model, tmp_path,
                                                                        monkeypatch):
    """On CPU the curves are kept in the kernel cache: a second engine of the same models and slots reads
    them (nothing timed, the same curves); fresh=True measures again and keeps what it measured for the
    next engine; so do other slots, another longest draft, or another drafter's models."""
    monkeypatch.setattr(cal, "plans_folder", lambda: tmp_path)
    measured = []
    real = CostModel.calibrate
    monkeypatch.setattr(CostModel, "calibrate", lambda self, *a, **k: measured.append(a[2]) or real(self, *a, **k))

    def engine(kind="draft-greedy", slots=4, g=3):
        made = make_engine(target_model, kind, draft_model, max_num_seqs=slots, max_model_len=128, g=g, adaptive=True)
        made.calibrate()
        return made
    first = engine()
    assert measured == [4] and first.costs_cached is False and first.costs.measured
    second = engine()
    assert measured == [4] and second.costs_cached and second.costs.measured
    for name in ("verify_curve", "draft_curve", "draft_prefill_s"):
        assert getattr(second.costs, name) == getattr(first.costs, name)
    second.calibrate(fresh=True)
    assert measured == [4, 4] and second.costs_cached is False
    third = engine()                                    # reads what the fresh measurement kept
    assert measured == [4, 4] and third.costs_cached and third.costs.verify_curve == second.costs.verify_curve
    engine(slots=3), engine(g=2), engine(kind="ngram")
    assert measured == [4, 4, 3, 4, 4]
    engine(kind="ngram")
    assert len(measured) == 5


def test_calibration_measures_non_decreasing_curves_and_the_drafts_prefill(target_model, draft_model):
    """The policy on this machine's own measured costs (no forced curves): the curves cover 1 token up
    to a full verify step, never decrease, and the engine stays lossless whatever they say."""
    engine = make_engine(target_model, "draft-greedy", draft_model, max_num_seqs=4, max_model_len=128, g=3,
                         adaptive=True)
    engine.calibrate()
    for curve, top in ((engine.costs.verify_curve, 4 * 4), (engine.costs.draft_curve, 4)):
        xs, ys = [x for x, _ in curve], [y for _, y in curve]
        assert xs[0] == 1 and xs[-1] == top and xs == sorted(set(xs))
        assert all(y > 0 for y in ys) and ys == sorted(ys)
    assert engine.costs.draft_prefill_s > 0
    prompts = mixed_prompts(8, target_model.config.vocab_size, seed=24)
    done, _ = run_requests(engine, prompts, SamplingParams(max_tokens=12, temperature=0), arrive_every=1)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, prompt, 12)
