"""End to end: with sampling and a draft, the distribution of whole 3-token continuations produced by
the engine matches exact enumeration of the target's probabilities (vocabulary 8: 512 outcomes).

N = 30,000 requests per case, each with its own generator (seeded from its id). Outcomes whose
expected count is below 5 are pooled into one bin. We fail when the chi-square p-value is below
ALPHA = 1e-5: a correct engine fails a case with probability 1e-5 (the seeds are fixed, so the
outcome is also reproducible). Power (references.detectable_shift, 90%): the test rejects a law that
moves 5% (plain), 6.6% (draft-greedy+filters), 8.7% (suffix cases), 12.2% (the other drafts) or 28.9%
(suffix-own-sampled-tree, a flatter law) of the most likely continuation's probability to the second
most likely one. The mutants (suffix
drafts verified against a q other than the one they were sampled from; sampled tree siblings verified
as if drawn with replacement) must fail the same test.
"""
import pytest
import torch

from conftest import make_engine, sample_outputs, tiers
from pipeline.engine import SamplingParams, TreeParams
from pipeline.engine.core.tree import is_chain
from pipeline.engine.core.verify import SparseProbs
from references import chi2_pvalue, target_law

LENGTH, N, ALPHA = 3, 30_000, 1e-5
PROMPT = [3, 1, 4, 1, 5]
REPEATING = [1, 2, 1, 3, 1, 2, 1, 4, 1]     # suffix-own: its own counts after 1 (2 twice, 3, 4), far from p


def exact_distribution(model, params: SamplingParams, prompt: list[int] = PROMPT) -> dict[tuple, float]:
    return target_law(model, prompt, params, LENGTH)


CASES = {      # name: (drafter, params[, attention]); attention: our CPU kernel unless "flex"
    # no drafts at all: the verifier's plain-decoding path (every row sampled, no draft rows)
    "plain": ("none", SamplingParams(max_tokens=LENGTH, temperature=0.7, top_p=0.9)),
    "draft-prob": ("draft-prob", SamplingParams(max_tokens=LENGTH, temperature=1.0)),
    "draft-prob-flex": ("draft-prob", SamplingParams(max_tokens=LENGTH, temperature=1.0), "flex"),
    "draft-greedy+filters": ("draft-greedy", SamplingParams(max_tokens=LENGTH, temperature=0.8, top_k=6, top_p=0.95)),
    "ngram": ("ngram", SamplingParams(max_tokens=LENGTH, temperature=1.0)),
    # Drafts come from the worker-wide index once the first wave of 256 has finished: the later
    # requests draft from earlier outputs, so drafts depend on what finished before (still exact).
    # "suffix" samples its drafts from the index's counts (sparse q); "suffix-greedy" drafts the most
    # frequent continuation (one-hot q); the hybrids mix suffix rows with the draft model's, one-hot
    # (sparse q over the batch) or probabilistic (dense q).
    "suffix": ("suffix", SamplingParams(max_tokens=LENGTH, temperature=0.9, top_k=6)),
    "suffix-greedy": ("suffix-greedy", SamplingParams(max_tokens=LENGTH, temperature=0.9, top_k=6)),
    "hybrid-suffix": ("hybrid-suffix", SamplingParams(max_tokens=LENGTH, temperature=1.0)),
    "hybrid-suffix-prob": ("hybrid-suffix-prob", SamplingParams(max_tokens=LENGTH, temperature=1.0)),
    # token trees (at most 6 tokens, 3 branches, depth 2) from the suffix index and n-gram lookup,
    # several candidates per position tried in turn with the residual updated between them: the
    # most frequent (one-hot), or with tree.sampled drawn from the counts without replacement
    # (sparse q, each sibling's without the ones drawn before it)
    "suffix-tree": ("suffix+tree", SamplingParams(max_tokens=LENGTH, temperature=0.9, top_k=6)),
    "suffix-sampled-tree": ("suffix+sampled-tree", SamplingParams(max_tokens=LENGTH, temperature=0.9, top_k=6)),
    "ngram-tree": ("ngram+tree", SamplingParams(max_tokens=LENGTH, temperature=1.0)),
    # the sequence's own text only, after a prompt that repeats: sampled trees whose counts are far
    # from the target's p, so later siblings are often tried (the worker-wide index's counts, made of
    # the target's own samples, come so close to p that the first sibling is nearly always accepted)
    "suffix-own-sampled-tree": ("suffix-own+sampled-tree", SamplingParams(max_tokens=LENGTH, temperature=1.0)),
}
TREES = {"tree": TreeParams(max_tokens=6, max_branches=3),
         "sampled-tree": TreeParams(max_tokens=6, max_branches=3, sampled=True)}


def run_case(models, kind, params, flex=False, wrong_q=False):
    """N requests through the engine: (counts of whole continuations, accepted, drafted, draft rows
    whose q had more than one token). wrong_q: the mutant that verifies sampled suffix drafts
    against a uniform q over each row's support instead of the counts they were drawn from."""
    target, draft = models
    kind, _, tree = kind.partition("+")
    prompt = REPEATING if kind == "suffix-own" else PROMPT
    engine = make_engine(target, kind, draft, max_num_seqs=256, max_model_len=16, g=2,
                         compile="on" if flex else "off", cpu_attention="off" if flex else "on",
                         tree=TREES[tree] if tree else TreeParams())
    spread, trees = [0], [0]
    if engine.drafter is not None:
        propose = engine.drafter.propose

        def observed(*args):
            batch = propose(*args)
            trees[0] += sum(len(p) > 0 and not is_chain(p) for p in batch.parents) if batch.is_tree else 0
            q = batch.draft_probs
            if isinstance(q, SparseProbs):
                spread[0] += int((torch.bincount(q.row) > 1).sum())
            elif q is not None:
                spread[0] += int(((q > 0).sum(-1) > 1).sum())
            if wrong_q and isinstance(q, SparseProbs):
                size = torch.bincount(q.row, minlength=len(batch.draft_ids)).float()
                q.prob = 1.0 / size[q.row]
            return batch
        engine.drafter.propose = observed
    counts, rounds = sample_outputs(engine, prompt, params, N, seed=11)
    accepted, drafted = sum(r.accepted for r in rounds), sum(r.draft_len for r in rounds)
    if tree:
        assert trees[0] > 1000, "the case must draft trees with more than one path"
    return counts, accepted, drafted, spread[0]


@pytest.mark.parametrize("case", tiers(list(CASES), {"hybrid-suffix-prob"}))
def test_continuations_match_exact_target(enumerable_models, case):
    kind, params, *attention = CASES[case]
    counts, accepted, drafted, spread = run_case(enumerable_models, kind, params, flex=attention == ["flex"])
    if kind == "none":
        assert drafted == 0
    else:
        assert 0 < accepted < drafted, "the case must exercise both acceptance and rejection"
    if kind in ("suffix", "hybrid-suffix", "hybrid-suffix-prob", "draft-prob") or kind.endswith("sampled-tree"):
        assert spread > 1000, "sampled drafts must come with q over more than one token"
    prompt = REPEATING if "own" in kind else PROMPT
    pvalue = chi2_pvalue(counts, exact_distribution(enumerable_models[0], params, prompt), N)
    assert pvalue > ALPHA, f"{case}: p-value {pvalue:.2e}"


@pytest.mark.slow
def test_sampled_tree_siblings_verified_against_the_full_counts_are_caught(enumerable_models, monkeypatch):
    """The mutant: sampled tree children drawn without replacement but each verified against the
    parent's whole distribution (the first sibling's q), as if drawn with replacement. The same
    chi-square test must reject it."""
    from pipeline.engine.drafting import trees
    draw = trees._draw

    def full_q(options, n, uniforms):
        picks = draw(options, n, uniforms)
        return [(*pick[:3], picks[0][3]) for pick in picks]
    monkeypatch.setattr(trees, "_draw", full_q)
    params = CASES["suffix-own-sampled-tree"][1]
    counts, _, _, spread = run_case(enumerable_models, "suffix-own+sampled-tree", params)
    assert spread > 1000
    pvalue = chi2_pvalue(counts, exact_distribution(enumerable_models[0], params, REPEATING), N)
    assert pvalue < ALPHA, f"the mutant passed: p-value {pvalue:.2e}"


@pytest.mark.slow
def test_sampled_suffix_drafts_with_a_wrong_q_are_caught(enumerable_models):
    """The mutant: suffix drafts sampled from the counts but verified against another q (uniform
    over the same support). The same chi-square test must reject it. (Verifying them as one-hot
    would be no mutant: a token-only draft is exact however it was chosen, at lower acceptance.)"""
    params = CASES["suffix"][1]
    counts, _, _, spread = run_case(enumerable_models, "suffix", params, wrong_q=True)
    assert spread > 1000
    pvalue = chi2_pvalue(counts, exact_distribution(enumerable_models[0], params), N)
    assert pvalue < ALPHA, f"the mutant passed: p-value {pvalue:.2e}"
