"""End to end: with sampling and a draft, the distribution of whole 3-token continuations produced by
the engine matches exact enumeration of the target's probabilities (vocabulary 8: 512 outcomes).

N = 30,000 requests per case, each with its own generator (seeded from its id). Outcomes whose
expected count is below 5 are pooled into one bin. We fail when the chi-square p-value is below
ALPHA = 1e-5: a correct engine fails a case with probability 1e-5 (the seeds are fixed, so the
outcome is also reproducible). A 1% error on the most likely outcomes is detected.
"""
import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from conftest import make_engine, noisy_copy, tiny_llama
from pipeline.engine import SamplingParams
from test_verify_exactness import reference_probs

VOCAB, LENGTH, N, ALPHA = 8, 3, 30_000, 1e-5
PROMPT = [3, 1, 4, 1, 5]


@torch.no_grad()
def exact_distribution(model, params: SamplingParams) -> dict[tuple, float]:
    prefixes = [()] + [tuple(c) for n in range(1, LENGTH) for c in itertools.product(range(VOCAB), repeat=n)]
    step = {}
    for prefix in prefixes:
        logits = model(input_ids=torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
        step[prefix] = reference_probs(logits.double().numpy(), params)
    return {seq: float(np.prod([step[seq[:i]][seq[i]] for i in range(LENGTH)]))
            for seq in itertools.product(range(VOCAB), repeat=LENGTH)}


def chi2_pvalue(counts: dict[tuple, int], exact: dict[tuple, float], n: int) -> float:
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, prob in exact.items():
        if prob * n >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(prob * n)
        else:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += prob * n
    assert sum(v for s, v in counts.items() if exact.get(s, 0.0) == 0.0) == 0, "impossible continuation"
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    expected = np.array(expected) * (n / sum(expected))
    return float(stats.chisquare(observed, expected).pvalue)


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(vocab=VOCAB, seed=5, init_range=0.15)
    return target, noisy_copy(target, noise=0.15, seed=6)


CASES = {      # name: (drafter, params[, attention]); attention: our CPU kernel unless "flex"
    # no drafts at all: the verifier's plain-decoding path (every row sampled, no draft rows)
    "plain": ("none", SamplingParams(max_tokens=LENGTH, temperature=0.7, top_p=0.9)),
    "draft-prob": ("draft-prob", SamplingParams(max_tokens=LENGTH, temperature=1.0)),
    "draft-prob-flex": ("draft-prob", SamplingParams(max_tokens=LENGTH, temperature=1.0), "flex"),
    "draft-greedy+filters": ("draft-greedy", SamplingParams(max_tokens=LENGTH, temperature=0.8, top_k=6, top_p=0.95)),
    "ngram": ("ngram", SamplingParams(max_tokens=LENGTH, temperature=1.0)),
    # Drafts come from the worker-wide index once the first wave of 256 has finished: the later
    # requests draft from earlier outputs, so drafts depend on what finished before (still exact).
    "suffix": ("suffix", SamplingParams(max_tokens=LENGTH, temperature=0.9, top_k=6)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_continuations_match_exact_target(models, case):
    target, draft = models
    kind, params, *attention = CASES[case]
    flex = attention == ["flex"]
    engine = make_engine(target, kind, draft, max_num_seqs=256, max_model_len=16, g=2,
                         compile="on" if flex else "off", cpu_attention="off" if flex else "on")
    for i in range(N):
        engine.add_request(f"r{i}", PROMPT, params, seed=11)
    counts: dict[tuple, int] = {}
    accepted = drafted = 0
    while engine.has_unfinished():
        out = engine.step()
        accepted += sum(r.accepted for r in out.rounds)
        drafted += sum(r.draft_len for r in out.rounds)
        for c in out.finished:
            key = tuple(c.output_ids)
            counts[key] = counts.get(key, 0) + 1
    assert sum(counts.values()) == N
    if kind == "none":
        assert drafted == 0
    else:
        assert 0 < accepted < drafted, "the case must exercise both acceptance and rejection"
    pvalue = chi2_pvalue(counts, exact_distribution(target, params), N)
    assert pvalue > ALPHA, f"{case}: p-value {pvalue:.2e}"
