"""Adaptive draft length: the policy's choices follow its cost model, a sequence that fell to g = 0 is
retried, and the adaptive engine stays lossless, prefilling the draft model only for sequences about
to draft (lazy catch-up, within the prefill budget)."""
from __future__ import annotations

import pytest
import torch

from conftest import dynamic_cache_keys, greedy_reference, make_engine, mixed_prompts, run_requests
from pipeline.engine import SamplingParams
from pipeline.engine.drafting.adaptive import AdaptiveDraftLength, CostModel, expected_tokens
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
    assert engine.policy.has_evidence
    drafted = sum(r.draft_len for r in rounds)
    if good:
        assert sum(r.accepted for r in rounds) == drafted
        late = [r for r in rounds if r.request_id in ("4", "5")]
        # everyone drafts now, but in each sequence's last round (max_tokens caps g at 0)
        assert late and sum(r.draft_len == 0 for r in late) <= 2
    else:
        assert engine.policy.evidence_tokens <= drafted <= engine.policy.evidence_tokens + 2 * 4
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, prompt, 24)


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
