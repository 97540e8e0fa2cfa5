"""Exactness on the real SmolLM2-135M at temperature 1: the first 3 generated tokens of the engine
with n-gram speculation are distributed as the target's, and a wrong verifier is caught.

Prompts: two short chats (chat template, system "Be brief.") whose earlier assistant reply the n-gram
drafter copies at the first round, so every request drafts 2 tokens at once ("A", " cat" and "1",
","); the target gives the first draft token probability ~0.30 and ~0.39, so drafts are accepted
and rejected often and the recovered-token rule is exercised. Temperature 1, top_p 1, no
penalties; every request has its own seed (disjoint per arm, fixed: reruns reproduce).

Tests per prompt, each with a false-failure probability of ALPHA = 1e-4 for a correct engine:
  - goodness of fit of the outcome counts against the exact target distribution, enumerated here
    with plain Hugging Face forwards (no engine code). Pooling: an outcome (3 tokens, or fewer ended
    by EOS) expected >= 5 times is its own bin; the others are pooled under their longest prefix
    whose remainder is expected >= 5 times, everything left in one bin (see `goodness_of_fit`);
  - the same for a NoDrafter engine arm, and a two-sample homogeneity test (chi2_contingency) of the
    speculative arm against it, outcomes expected < 5 times in either arm pooled into one bin.
N = 300 speculative, N_NONE = 100 NoDrafter requests per prompt. Sizes are set by time: one thread
prefills ~270 prompt tokens/s here, ~0.15 s per request, and the file takes ~3.6 min of CPU. The
goodness-of-fit test is the strong one (the exact reference is an infinite second sample); the
homogeneity test at these sizes only catches gross differences.

Mutant: a verifier that on rejection resamples from p instead of norm(max(p - q, 0)) (`_q_rows`
patched to 0; q is one-hot on the rejected draft, so the rejected token can be drawn again): the
first draft token's probability rises from p to p(2 - p). N_MUTANT = 260 requests per prompt; the
goodness-of-fit test must reject it (p-value < ALPHA).

Observed with these seeds: correct n-gram arm goodness of fit p = 0.54 (animal), 0.87 (count);
NoDrafter arm 0.80, 0.27; homogeneity 0.26, 0.27. Mutant goodness of fit p = 1.2e-17 and 1.7e-12
(homogeneity vs the 100 NoDrafter samples 6e-4 and 2e-4: not asserted). Power, from 4 other seed
sets at N_MUTANT = 160 (development runs): animal 2e-19, 7e-14, 1e-13, 0.025 (3 of 4 rejected);
count 7e-10, 1e-11, 4e-15, 5e-6 (4 of 4). At 260 the noncentrality is ~1.6x that, so a miss like
the 0.025 seed set is rare but not impossible for another seed choice.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy import stats

from pipeline.engine import DraftingConfig, EngineConfig, NgramDrafter, SamplingParams, SpecEngine
from pipeline.engine.core import verify as verify_module
from pipeline.engine.model.runner import build_runner
from references import bins_pvalue, prefix_bins

MODEL = "smollm2-135m-instruct"
LENGTH, N, N_NONE, N_MUTANT, ALPHA, MIN_EXPECTED = 3, 300, 100, 260, 1e-4, 5
BATCH = 64
PARAMS = SamplingParams(max_tokens=LENGTH, temperature=1.0, top_p=1.0)
SYSTEM = {"role": "system", "content": "Be brief."}
CHATS = {   # the last assistant reply is what the n-gram drafter proposes at the first round
    "animal": [{"role": "user", "content": "Name an animal."}, {"role": "assistant", "content": "A cat."},
               {"role": "user", "content": "Again."}],
    "count": [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1, 2, 3"},
              {"role": "user", "content": "Count to three again."}],
}
SEED_BASE = {"ngram": 0, "none": 1_000_000, "mutant": 2_000_000}   # disjoint seeds per arm


@pytest.fixture(scope="module")
def smollm():
    from pipeline.loading.files import check_source
    from pipeline.loading.models import ModelSpec, load_model
    try:
        check_source(MODEL)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    torch.set_num_threads(1)
    return load_model(ModelSpec(MODEL, "float32", "cpu"))


@pytest.fixture(scope="module")
def prompts(smollm):
    from pipeline.job.rows import prompt_ids
    _, tokenizer = smollm
    return {name: prompt_ids(tokenizer, messages=[SYSTEM, *chat]) for name, chat in CHATS.items()}


@pytest.fixture(scope="module")
def eos(smollm):
    from pipeline.job.runtime import eos_ids
    return eos_ids(*smollm)


@pytest.fixture(scope="module")
def exact(smollm, prompts, eos):
    """Exact outcome probabilities per prompt, computed before any engine packs the model."""
    model, _ = smollm
    return {name: exact_outcomes(model, prompt, eos, MIN_EXPECTED / N) for name, prompt in prompts.items()}


# ---- reference and statistics ---------------------------------------------------------------------
@dataclass
class Exact:
    """The target's exact probabilities, each >= the enumeration's min_prob."""
    outcomes: dict[tuple, float]      # LENGTH tokens, or fewer ending in EOS
    prefixes: dict[tuple, float]      # 1..LENGTH-1 tokens, not ending in EOS


@torch.no_grad()
def exact_outcomes(model, prompt: list[int], eos: list[int], min_prob: float) -> Exact:
    """Every outcome and prefix with probability >= min_prob, expanding the prefix tree level by
    level (a prefix is at least as likely as its outcomes). Plain Hugging Face forwards (no KV cache,
    no engine code), softmax of the raw logits in float64."""
    frontier, exact = {(): 1.0}, Exact({}, {})
    for level in range(LENGTH):
        prefixes = list(frontier)
        batch = torch.tensor([prompt + list(p) for p in prefixes])                  # [prefixes, len]
        probs = torch.softmax(model(input_ids=batch).logits[:, -1].double(), -1)    # [prefixes, vocab]
        joint = probs * torch.tensor([frontier[p] for p in prefixes], dtype=torch.float64).unsqueeze(1)
        frontier = {}
        for row, tok in (joint >= min_prob).nonzero().tolist():
            ends = tok in eos or level == LENGTH - 1
            (exact.outcomes if ends else frontier)[prefixes[row] + (tok,)] = float(joint[row, tok])
        exact.prefixes.update(frontier)
    return exact


def goodness_of_fit(counts: collections.Counter, exact: Exact) -> float:
    """Chi-square p-value of the counts against the exact distribution, over references.prefix_bins
    (outcomes expected < MIN_EXPECTED times pooled under the prefixes the enumeration kept). Bins come
    from the exact distribution only, never from counts."""
    n = sum(counts.values())
    bins = prefix_bins(exact.outcomes, n, MIN_EXPECTED, exact.prefixes)
    assert bins[()] * n >= MIN_EXPECTED, "the remainder bin is too small for a chi-square test"
    return bins_pvalue(counts, bins)


def homogeneity(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square test of homogeneity; outcomes whose expected count in either sample is
    below MIN_EXPECTED are pooled into one bin."""
    na, nb = sum(a.values()), sum(b.values())
    share = min(na, nb) / (na + nb)
    outcomes = sorted(set(a) | set(b))
    kept = [o for o in outcomes if (a[o] + b[o]) * share >= MIN_EXPECTED]
    table = [[a[o] for o in kept] + [na - sum(a[o] for o in kept)],
             [b[o] for o in kept] + [nb - sum(b[o] for o in kept)]]
    table = np.array(table)
    table = table[:, table.sum(axis=0) > 0]                       # an empty pooled bin is no bin
    return float(stats.chi2_contingency(table, correction=False).pvalue)


# ---- sampling -------------------------------------------------------------------------------------
def sample(model, prompt: list[int], eos: list[int], drafter, n: int, seed_base: int):
    """n requests of the prompt (request i has seed seed_base + i). Returns the outcome counts and
    per first-round draft position [drafted, accepted] totals."""
    cfg = EngineConfig(max_num_seqs=BATCH, max_model_len=len(prompt) + LENGTH + 1, max_prefill_tokens=2048)
    engine = SpecEngine(build_runner(model, BATCH, cfg.max_model_len), drafter, cfg, eos,
                        drafting=DraftingConfig(num_speculative_tokens=4, adaptive=False))
    for i in range(n):
        engine.add_request(f"r{i}", prompt, PARAMS, seed=seed_base + i)
    counts, first_round = collections.Counter(), np.zeros((2, 2), dtype=int)   # [position, (drafted, accepted)]
    while engine.has_unfinished():
        out = engine.step()
        for r in out.rounds:
            if r.round == 0:
                for pos, ok in enumerate(r.accepted_mask[:2]):
                    first_round[pos] += (1, int(ok))
        counts.update(tuple(c.output_ids) for c in out.finished)
    assert sum(counts.values()) == n
    return counts, first_round


def wrong_q_rows(draft_probs, draft_ids, rows, vocab, dtype):
    """Mutant: q = 0 in the residual, so a rejection resamples from p (the rejected token included)."""
    return torch.zeros(len(rows), vocab, dtype=dtype, device=draft_ids.device)


# ---- tests ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def arms(smollm, prompts, eos, exact):
    """Outcome counts per prompt: n-gram speculation, NoDrafter, and n-gram with the mutant verifier
    (after `exact`: the runners pack the model's linears in place)."""
    model, _ = smollm
    result = {}
    for name, prompt in prompts.items():
        ngram, first_round = sample(model, prompt, eos, NgramDrafter(2, 4), N, SEED_BASE["ngram"])
        none, _ = sample(model, prompt, eos, None, N_NONE, SEED_BASE["none"])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(verify_module, "_q_rows", wrong_q_rows)
            mutant, _ = sample(model, prompt, eos, NgramDrafter(2, 4), N_MUTANT, SEED_BASE["mutant"])
        result[name] = dict(ngram=ngram, none=none, mutant=mutant, first_round=first_round)
    return result


def test_the_exact_reference_holds_most_of_the_law_and_bins_n_samples(exact):
    """The fast tier's check of this file's reference (the arms below take minutes): per prompt the
    enumerated outcomes and prefixes are probabilities (an outcome no likelier than its prefix), and the
    bins the goodness-of-fit tests use partition the whole law, each expecting >= MIN_EXPECTED of N."""
    for name, law in exact.items():
        assert 0 < sum(law.outcomes.values()) <= 1 + 1e-9
        assert all(p <= law.prefixes[out[:-1]] + 1e-12 for out, p in law.outcomes.items() if len(out) > 1)
        bins = prefix_bins(law.outcomes, N, MIN_EXPECTED, law.prefixes)
        assert sum(bins.values()) == pytest.approx(1.0) and len(bins) > 2, (name, len(bins))
        assert min(bins.values()) * N >= MIN_EXPECTED, name


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHATS))
def test_drafts_are_proposed_accepted_and_rejected(arms, name):
    first_round = arms[name]["first_round"]
    assert first_round[0, 0] == N and first_round[1, 0] == N, "every request drafts 2 tokens at round 0"
    accepted = first_round[0, 1] / N
    assert 0.15 < accepted < 0.85, f"first draft accepted {accepted:.2f}: the mutant needs rejections"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHATS))
def test_speculative_samples_match_target(arms, exact, name):
    counts, none = arms[name]["ngram"], arms[name]["none"]
    fit, fit_none, same = goodness_of_fit(counts, exact[name]), goodness_of_fit(none, exact[name]), \
        homogeneity(counts, none)
    print(f"{name}: goodness of fit ngram {fit:.3g}, none {fit_none:.3g}; homogeneity {same:.3g}")
    assert fit > ALPHA and fit_none > ALPHA and same > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHATS))
def test_mutant_verifier_is_rejected(arms, exact, name):
    mutant = arms[name]["mutant"]
    fit, same = goodness_of_fit(mutant, exact[name]), homogeneity(mutant, arms[name]["none"])
    print(f"{name}: mutant goodness of fit {fit:.3g}, homogeneity vs none {same:.3g} (not asserted: too "
          f"few samples for the two-sample test to reach ALPHA)")
    assert fit < ALPHA
