"""Verifier exactness: chi-square goodness of fit of the emitted tokens against the exact processed
target distribution, computed here independently (numpy) from the raw logits.

Each case draws N = 200,000 independent rounds (g = 2 draft tokens each) in one batched call. For a
correct verifier every p-value is uniform on [0, 1]; we fail below ALPHA = 1e-5, so each check has a
1e-5 chance of a false failure (about 1e-4 over the whole file with fixed seeds, which also makes
the outcome reproducible). The deliberately wrong verifier (resample from p instead of the residual)
is off by several percent in these cases and gives p-values far below 1e-100.
"""
import numpy as np
import pytest
import torch

from pipeline.engine.core.sampling import RowParams, processed_probs
from pipeline.engine.core.request import SamplingParams
from references import chi2_pvalue, reference_probs
from pipeline.engine.core.verify import SparseProbs, sample_from_probs, verify

N, G, VOCAB, ALPHA = 200_000, 2, 8, 1e-5


def token_pvalue(samples: np.ndarray, expected_probs: np.ndarray) -> float:
    """chi2_pvalue of emitted tokens, every token of nonzero probability its own cell (no pooling)."""
    counts = np.bincount(samples, minlength=len(expected_probs)).tolist()
    return chi2_pvalue(dict(enumerate(counts)), dict(enumerate(expected_probs)), len(samples), min_expected=0)


def wrong_verify(draft_ids, cu, target_probs, draft_probs, is_greedy, acc_u, smp_u):
    """Rejection with min(1, p/q) but then resampling from p instead of norm([p - q]+)."""
    out = verify(draft_ids, cu, target_probs, draft_probs, is_greedy, acc_u, smp_u)
    rejected = out.num_accepted < (cu[1:] - cu[:-1])
    rows = cu[:-1] + torch.arange(len(cu) - 1) + out.num_accepted
    resampled = sample_from_probs(target_probs[rows], smp_u)
    idx = torch.arange(len(cu) - 1)
    out.output_ids[idx[rejected], out.num_accepted[rejected]] = resampled[rejected]
    return out


CASES = {
    "probabilistic-q": (SamplingParams(temperature=1.0), "probabilistic"),
    "onehot-q": (SamplingParams(temperature=1.0), "onehot"),
    "filters-probabilistic": (SamplingParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05), "probabilistic"),
    "filters-onehot": (SamplingParams(temperature=1.3, top_k=5, top_p=0.8, min_p=0.02), "onehot"),
    # a suffix index's q: a few tokens per row (SparseProbs), some outside the target's top-k
    "sparse-q": (SamplingParams(temperature=0.8, top_k=6), "sparse"),
}


def run_case(params: SamplingParams, q_kind: str, verify_fn, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(G + 1, VOCAB, generator=gen) * 1.5      # p_1..p_{g+1}
    draft_logits = target_logits[:G] + torch.randn(G, VOCAB, generator=gen)   # a q close to p
    rp = RowParams.from_params([params] * (G + 1), "cpu")
    p = processed_probs(target_logits, rp)                               # [g+1, vocab]
    q = processed_probs(draft_logits, RowParams.from_params([params] * G, "cpu"))
    if q_kind == "sparse":                  # q on 3 tokens per position (counts 3:2:1), as COO entries
        q = torch.zeros(G, VOCAB)
        for i in range(G):
            q[i, torch.randperm(VOCAB, generator=gen)[:3]] = torch.tensor([3.0, 2.0, 1.0]) / 6
    if q_kind in ("probabilistic", "sparse"):
        drafts = torch.stack([sample_from_probs(q[i].expand(N, VOCAB), torch.rand(N, generator=gen))
                              for i in range(G)], dim=1)                 # [N, g]
        draft_probs = q.repeat(N, 1)                                     # [N * g, vocab]
        if q_kind == "sparse":
            nz = draft_probs.nonzero()
            draft_probs = SparseProbs(nz[:, 0], nz[:, 1], draft_probs[nz[:, 0], nz[:, 1]])
    else:   # token-only draft: the draft's top choice at each position, q one-hot
        drafts = q.argmax(dim=-1).expand(N, G)
        draft_probs = None
    cu = torch.arange(0, N * G + 1, G)
    out = verify_fn(drafts.reshape(-1), cu, p.repeat(N, 1), draft_probs, torch.zeros(N, dtype=torch.bool),
                    torch.rand(N * G, generator=gen), torch.rand(N, generator=gen))
    expected = [reference_probs(target_logits[i].numpy(), params) for i in range(G + 1)]
    return out, expected


def pvalues(out, expected) -> dict[str, float]:
    first = out.output_ids[:, 0].numpy()
    all_acc = (out.num_accepted == G).numpy()
    second = out.output_ids[out.num_accepted >= 1, 1].numpy()
    bonus = out.output_ids[torch.from_numpy(all_acc), G].numpy()
    return {"first": token_pvalue(first, expected[0]),
            "second|first accepted": token_pvalue(second, expected[1]),
            "bonus": token_pvalue(bonus, expected[G])}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_verifier_matches_target(case):
    params, q_kind = CASES[case]
    out, expected = run_case(params, q_kind, verify)
    for name, pv in pvalues(out, expected).items():
        assert pv > ALPHA, f"{case}/{name}: p-value {pv:.2e}"
    rate = out.num_accepted.float().mean().item()
    assert 0 < rate < G, "the case must exercise both acceptance and rejection"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["probabilistic-q", "onehot-q", "filters-probabilistic", "sparse-q"])
def test_wrong_verifier_is_rejected(case):
    params, q_kind = CASES[case]
    out, expected = run_case(params, q_kind, wrong_verify)
    assert pvalues(out, expected)["first"] < ALPHA


def test_sparse_q_verifies_exactly_as_the_same_q_dense():
    """SparseProbs is a layout, not a rule: the same q dense or sparse gives the same output bitwise."""
    gen = torch.Generator().manual_seed(3)
    num_seqs, g, vocab = 64, 3, 50
    p = torch.softmax(torch.randn(num_seqs * (g + 1), vocab, generator=gen) * 2, dim=-1)
    q = torch.rand(num_seqs * g, vocab, generator=gen) * (torch.rand(num_seqs * g, vocab, generator=gen) < 0.1)
    q[:, 0] += 0.01                                                     # every row some support
    q /= q.sum(-1, keepdim=True)
    draft_ids = sample_from_probs(q, torch.rand(num_seqs * g, generator=gen))
    cu = torch.arange(0, num_seqs * g + 1, g)
    nz = q.nonzero()
    sparse = SparseProbs(nz[:, 0], nz[:, 1], q[nz[:, 0], nz[:, 1]])
    args = (torch.zeros(num_seqs, dtype=torch.bool), torch.rand(num_seqs * g, generator=gen),
            torch.rand(num_seqs, generator=gen))
    dense_out, sparse_out = verify(draft_ids, cu, p, q, *args), verify(draft_ids, cu, p, sparse, *args)
    assert torch.equal(dense_out.output_ids, sparse_out.output_ids)
    assert torch.equal(dense_out.is_accepted, sparse_out.is_accepted)
    assert 0 < int(dense_out.num_accepted.sum()) < num_seqs * g


def test_processed_probs_matches_reference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen) * 2
    params = [SamplingParams(temperature=0.5, top_k=10), SamplingParams(temperature=1.0, top_p=0.7),
              SamplingParams(temperature=2.0, min_p=0.1), SamplingParams(temperature=0.9, top_k=20, top_p=0.5)]
    got = processed_probs(logits, RowParams.from_params(params, "cpu")).double().numpy()
    for r, p in enumerate(params):
        np.testing.assert_allclose(got[r], reference_probs(logits[r].numpy(), p), atol=1e-6)


def test_greedy_rows_are_onehot_on_penalised_argmax():
    logits = torch.tensor([[1.0, 3.0, 2.9, -1.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    rp = RowParams.from_params([params], "cpu")
    out_counts = torch.tensor([[0.0, 1.0, 0.0, 0.0]])      # token 1 already generated -> 3.0 / 2 = 1.5
    probs = processed_probs(logits, rp, out_counts, torch.zeros_like(out_counts))
    assert probs.tolist() == [[0.0, 0.0, 1.0, 0.0]]


def test_greedy_fast_path_equals_general_verifier():
    """verify_greedy (argmax only) must agree with verify's greedy rule on a ragged batch."""
    from pipeline.engine.core.verify import verify_greedy
    gen = torch.Generator().manual_seed(9)
    num_draft = torch.tensor([0, 3, 1, 4, 2])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), num_draft.cumsum(0)])
    p = torch.randn(int(cu[-1]) + len(num_draft), 6, generator=gen).softmax(-1)
    target_argmax = p.argmax(-1)
    _, _, target_row = __import__("pipeline.engine.core.verify", fromlist=["_flat_index"])._flat_index(cu, int(cu[-1]))
    # drafts agree with the target's argmax about half the time
    drafts = torch.where(torch.rand(int(cu[-1]), generator=gen) < 0.6, target_argmax[target_row],
                         torch.randint(0, 6, (int(cu[-1]),), generator=gen))
    fast = verify_greedy(drafts, cu, target_argmax)
    slow = verify(drafts, cu, p, None, torch.ones(5, dtype=torch.bool), torch.rand(int(cu[-1])), torch.rand(5))
    assert torch.equal(fast.output_ids, slow.output_ids) and torch.equal(fast.num_accepted, slow.num_accepted)
    assert 0 < int(fast.num_accepted.sum()) < int(num_draft.sum())
