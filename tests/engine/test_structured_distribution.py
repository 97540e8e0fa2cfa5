"""Structured output, sampled: with a grammar, the distribution of whole outputs produced by the
engine matches exact enumeration of the target restricted to the grammar (masked, renormalised), for
plain decoding with forced tokens and for every kind of draft: n-gram (one-hot, cut at forbidden
tokens), suffix sampled from counts (sparse q, a forbidden draw kept and rejected), a draft model
drafting under the mask (dense q), the hybrid of the last two, and token trees under the forced
tokens (n-gram's one-hot, the suffix index's drawn from its counts).

The vocabulary is 8 tokens: <eos>, a, b, c, ab, ba, {, } and the grammar `"{" ("a" | "b")+ "}"`, so
"{" is forced, "ab" can also be spelled "a" "b" (the mask allows both), and "}" then <eos> end the
output; max_tokens 5 cuts the longer ones. N = 20,000 requests per case, each with its own
generators. Outcomes expected fewer than 5 times are pooled. A case fails when the chi-square
p-value is below ALPHA = 1e-5: a correct engine fails a case with probability 1e-5 (seeds are fixed:
reproducible). Power (references.detectable_shift, 90%): a law moving 9.0% (suffix, suffix-sampled-tree)
to 14.1% (the others) of the most likely output's probability to the second most likely one is rejected.
The mutant (the target masked but not renormalised: acceptance weighed against the
unmasked target's probabilities) must fail the same test.
"""
import pytest

import pipeline.engine.engine as engine_module
from conftest import make_engine, sample_outputs, tiers
from pipeline.engine import SamplingParams, TreeParams
from pipeline.engine.core.sampling import bitmask_to_bool
from references import TINY_EOS, chi2_pvalue, target_law, tiny_grammars

EOS, LENGTH, N, ALPHA = TINY_EOS, 5, 20_000, 1e-5
PROMPT = [3, 1, 4, 1, 5]
ACAC = [1, 3, 1, 3, 1, 2, 1]    # suffix-own: its own counts after "a" are "c" twice and "b" once: mostly forbidden
GRAMMAR = {"type": "grammar", "grammar": 'start: "{" ("a" | "b")+ "}"'}


@pytest.fixture(scope="module")
def grammars():
    return tiny_grammars()


def exact_distribution(model, grammars, params, prompt: list[int] = PROMPT) -> dict[tuple, float]:
    """Every output (ending in <eos> or cut at LENGTH tokens) with its probability under the masked,
    renormalised target: enumeration with llguidance's matcher driven directly."""
    return target_law(model, prompt, params, LENGTH, {EOS}, grammars)


def run_case(models, grammars, kind, params):
    target, draft = models
    kind, _, tree = kind.partition("+")
    prompt = ACAC if kind == "suffix-own" else PROMPT
    engine = make_engine(target, kind, draft, max_num_seqs=256, max_model_len=16, g=2, eos=[EOS], grammars=grammars,
                         tree=TREES[tree] if tree else TreeParams())
    counts, rounds = sample_outputs(engine, prompt, params, N, seed=11)
    stats = dict(drafted=0, accepted=0, forced=0, forced_accepted=0, trees=0)
    for r in rounds:
        stats["trees"] += r.paths > 1
        stats["drafted"] += r.draft_len - r.forced
        stats["accepted"] += r.accepted - r.forced_accepted
        stats["forced"] += r.forced
        stats["forced_accepted"] += r.forced_accepted
    return counts, stats


CASES = {
    "plain+forced": ("none", SamplingParams(max_tokens=LENGTH, temperature=1.0, response_format=GRAMMAR)),
    "ngram": ("ngram", SamplingParams(max_tokens=LENGTH, temperature=1.0, response_format=GRAMMAR)),
    "suffix": ("suffix", SamplingParams(max_tokens=LENGTH, temperature=0.9, top_k=3, response_format=GRAMMAR)),
    "draft-prob": ("draft-prob", SamplingParams(max_tokens=LENGTH, temperature=1.0, response_format=GRAMMAR)),
    "hybrid-suffix-prob": ("hybrid-suffix-prob", SamplingParams(max_tokens=LENGTH, temperature=1.0,
                                                                response_format=GRAMMAR)),
    # token trees under the forced tokens: n-gram's one-hot (forbidden tokens dropped with their
    # subtrees), the suffix index's drawn from its counts (forbidden draws kept, rejected for sure)
    "ngram-tree": ("ngram+tree", SamplingParams(max_tokens=LENGTH, temperature=1.0, response_format=GRAMMAR)),
    "suffix-sampled-tree": ("suffix+sampled-tree", SamplingParams(max_tokens=LENGTH, temperature=0.9, top_k=3,
                                                                  response_format=GRAMMAR)),
    # the sequence's own text only, after a prompt where "a" goes on with "c": most draws the grammar
    # forbids, each kept for its sure rejection
    "suffix-own-sampled-tree": ("suffix-own+sampled-tree", SamplingParams(max_tokens=LENGTH, temperature=1.0,
                                                                          response_format=GRAMMAR)),
}
TREES = {"tree": TreeParams(max_tokens=6, max_branches=3),
         "sampled-tree": TreeParams(max_tokens=6, max_branches=3, sampled=True)}


@pytest.mark.parametrize("case", tiers(list(CASES), {"hybrid-suffix-prob"}))
def test_outputs_match_the_masked_target(enumerable_models, grammars, case):
    kind, params = CASES[case]
    counts, stats = run_case(enumerable_models, grammars, kind, params)
    assert stats["forced"] > 0 and stats["forced_accepted"] > 0
    if kind != "none":
        assert 0 < stats["accepted"] < stats["drafted"], "the case must exercise acceptance and rejection"
    if "tree" in kind:
        assert stats["trees"] > 1000, "the case must draft trees with more than one path"
    prompt = ACAC if kind.startswith("suffix-own") else PROMPT
    pvalue = chi2_pvalue(counts, exact_distribution(enumerable_models[0], grammars, params, prompt), N)
    assert pvalue > ALPHA, f"{case}: p-value {pvalue:.2e}"


@pytest.mark.slow
def test_verifying_against_the_unmasked_target_is_caught(enumerable_models, grammars, monkeypatch):
    """The mutant: the verifier's p is the target's probabilities with forbidden tokens zeroed but not
    renormalised, so a draft token is accepted with the unmasked target's p(y). Recovered tokens still
    come from allowed ones, so the output parses; only its distribution is wrong, and the test sees it."""
    row_probs = engine_module.row_probs

    def unrenormalised(logits, seqs, extra, argmax_only=False, allowed=None):
        if argmax_only or allowed is None:
            return row_probs(logits, seqs, extra, argmax_only, allowed)
        return row_probs(logits, seqs, extra) * bitmask_to_bool(allowed, logits.shape[-1])

    monkeypatch.setattr(engine_module, "row_probs", unrenormalised)
    kind, params = CASES["ngram"]
    counts, stats = run_case(enumerable_models, grammars, kind, params)
    assert stats["drafted"] > 1000
    pvalue = chi2_pvalue(counts, exact_distribution(enumerable_models[0], grammars, params), N)
    assert pvalue < ALPHA, f"the mutant passed: p-value {pvalue:.2e}"


@pytest.mark.slow
def test_dropping_forbidden_draws_from_sampled_trees_is_caught(enumerable_models, grammars, monkeypatch):
    """The mutant: a sampled tree's forbidden draws dropped like one-hot tokens instead of kept for
    their sure rejection, so the residual after them, norm([r - q]+), is never drawn. The same
    chi-square test must reject it."""
    from pipeline.engine.grammar.walk import RoundWalk
    walk_tree = RoundWalk.walk_tree
    monkeypatch.setattr(RoundWalk, "walk_tree", lambda self, b, tokens, parents, one_hot:
                        walk_tree(self, b, tokens, parents, [True] * len(tokens)))
    kind, params = CASES["suffix-own-sampled-tree"]
    counts, stats = run_case(enumerable_models, grammars, kind, params)
    assert stats["trees"] > 1000
    pvalue = chi2_pvalue(counts, exact_distribution(enumerable_models[0], grammars, params, ACAC), N)
    assert pvalue < ALPHA, f"the mutant passed: p-value {pvalue:.2e}"
