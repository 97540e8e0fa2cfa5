"""Token-tree verification (core/verify_tree.py): greedy against a reference walk, the single path
against verify.py's rule, and exactness under sampling by chi-square.

Chi-square: a toy target over VOCAB = 5 tokens whose next-token distribution depends on the last two
tokens (a fixed Dirichlet(1.5) table) generates the first LENGTH = 3 tokens of N = 20,000 sequences in
rounds of speculative trees, all sequences verified together in one call per round. Every round
each sequence gets a fresh random tree shape (1-4 children per token, depth 1-4, at most 16 tokens,
siblings listed apart in half of them) with tokens that are one-hot (a draft table's likeliest first, as a suffix index ranks
continuations), drawn
i.i.d. from a dense draft q, drawn without replacement from a dense q, or drawn without replacement
from a sparse q of 3 tokens. The 125 outcomes are compared with the exact product of conditionals;
outcomes expected fewer than 5 times are pooled. A case fails when the p-value is below ALPHA = 1e-5,
so a correct verifier fails a case with probability 1e-5 (seeds are fixed: reproducible). Two
mutants must fail the same test: siblings tried against a residual not updated for the rejected
ones, and a token tried after its parent was rejected.
"""
import itertools

import numpy as np
import pytest
import torch

import pipeline.engine.core.verify_tree as vt
from pipeline.engine.core.tree import chain, children, depths, path_to, visible_inputs
from pipeline.engine.core.verify import SparseProbs, verify, verify_greedy
from pipeline.engine.core.verify_tree import verify_tree, verify_tree_greedy
from conftest import tiers
from references import chi2_pvalue

VOCAB, START, LENGTH, N, ALPHA, MAX_TOKENS = 5, 5, 3, 20_000, 1e-5, 16


def random_shape(rng: np.random.Generator) -> list[int]:
    """Parents of a random tree (module docstring), in breadth-first or depth-first order."""
    parents, level = [], [-1]
    for _ in range(int(rng.integers(1, 5))):
        new = []
        for p in level:
            k = int(rng.integers(1, 5)) if p == -1 or rng.random() < 0.8 else 0
            for _ in range(k):
                if len(parents) < MAX_TOKENS:
                    parents.append(p)
                    new.append(len(parents) - 1)
        level = new
    if rng.random() < 0.5:                      # depth-first: siblings no longer side by side
        kids, order = children(parents), []
        def visit(j):
            for c in kids[j + 1]:
                order.append(c)
                visit(c)
        visit(-1)
        where = {old: new for new, old in enumerate(order)}
        parents = [where[parents[old]] if parents[old] >= 0 else -1 for old in order]
    return parents


class ToyModels:
    """p and q after a prefix: Dirichlet tables indexed by the last two tokens."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed)
        self.p = rng.dirichlet([1.5] * VOCAB, size=(VOCAB + 1, VOCAB + 1))   # spread: every sibling matters
        self.q = rng.dirichlet([1.5] * VOCAB, size=(VOCAB + 1, VOCAB + 1))

    @staticmethod
    def _key(prefix):
        ctx = [START, START] + list(prefix)
        return ctx[-2], ctx[-1]

    def target(self, prefix) -> np.ndarray:
        return self.p[self._key(prefix)]

    def draft(self, prefix) -> np.ndarray:
        return self.q[self._key(prefix)]

    def exact(self) -> dict[tuple, float]:
        out = {}
        for seq in itertools.product(range(VOCAB), repeat=LENGTH):
            prob = 1.0
            for i, t in enumerate(seq):
                prob *= self.target(seq[:i])[t]
            out[seq] = prob
        return out


def draft_tree(models: ToyModels, prefix: list[int], kind: str, rng: np.random.Generator):
    """A random tree after `prefix`: (parents, tokens, q rows as (support, probs) or None)."""
    parents = random_shape(rng)
    tokens, qrows = [0] * len(parents), []
    for holder, kids in enumerate(children(parents)):
        path = prefix + [tokens[j] for j in path_to(parents, holder - 1)]
        q = models.draft(path)
        if kind == "sparse":                     # a support of 3 tokens with counts 3:2:1
            support = rng.permutation(VOCAB)[:3]
            q = np.zeros(VOCAB)
            q[support] = [3 / 6, 2 / 6, 1 / 6]
        left = q.copy()
        ranked = np.argsort(-q, kind="stable")       # one-hot: q's likeliest first, as an index's counts
        for rank, c in enumerate(kids):
            if kind == "onehot":
                tokens[c] = int(ranked[rank % VOCAB])
                continue
            draw_from = left / left.sum()
            tokens[c] = int(rng.choice(VOCAB, p=draw_from))
            qrows.append((c, draw_from))
            if kind != "iid":                    # without replacement: the next sibling's q lacks it
                left[tokens[c]] = 0.0
                if left.sum() <= 0:
                    left = q.copy()
    return parents, tokens, (None if kind == "onehot" else dict(qrows))


def generate(models: ToyModels, kind: str, seed: int) -> dict[tuple, int]:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    out = [[] for _ in range(N)]
    while True:
        live = [b for b in range(N) if len(out[b]) < LENGTH]
        if not live:
            break
        trees = [draft_tree(models, out[b], kind, rng) for b in live]
        ids, parents, cu, p_rows, q_entries = [], [], [0], [], []
        for b, (par, toks, q) in zip(live, trees):
            ids += toks
            parents += par
            cu.append(cu[-1] + len(toks))
            p_rows.append(models.target(out[b]))
            p_rows += [models.target(out[b] + [toks[j] for j in path_to(par, i)]) for i in range(len(toks))]
            if q is not None:
                q_entries += [q[i] for i in range(len(toks))]
        draft_probs = None
        if kind == "sparse":
            rows = [[(list(np.flatnonzero(r)), list(r[np.flatnonzero(r)])) for r in q_entries]]
            draft_probs = SparseProbs.from_lists(rows, "cpu")
        elif kind != "onehot":
            draft_probs = torch.tensor(np.array(q_entries), dtype=torch.float64)
        res = verify_tree(torch.tensor(ids), torch.tensor(cu), torch.tensor(parents),
                          torch.tensor(np.array(p_rows)), draft_probs, torch.zeros(len(live), dtype=torch.bool),
                          torch.rand(len(ids), generator=gen, dtype=torch.float64),
                          torch.rand(len(live), generator=gen, dtype=torch.float64))
        for row, b in enumerate(live):
            k = int(res.num_accepted[row])
            out[b] += res.output_ids[row, :k + 1].tolist()
    counts: dict[tuple, int] = {}
    for seq in out:
        key = tuple(seq[:LENGTH])
        counts[key] = counts.get(key, 0) + 1
    return counts


KINDS = ["onehot", "iid", "without-replacement", "sparse"]


@pytest.mark.parametrize("kind", tiers(KINDS, {"iid"}))
def test_tree_sampling_is_exact(kind):
    models = ToyModels(seed=11)
    counts = generate(models, kind, seed=KINDS.index(kind) + 1)
    assert chi2_pvalue(counts, models.exact(), N) > ALPHA


def test_mutant_without_residual_update_is_caught(monkeypatch):
    monkeypatch.setattr(vt, "_residual", lambda rows, total, q_rows: rows)
    models = ToyModels(seed=11)
    assert chi2_pvalue(generate(models, "onehot", seed=1), models.exact(), N) < ALPHA


def test_mutant_trying_below_a_rejected_token_is_caught(monkeypatch):
    links = vt._tree_links

    def below_rejected(idx, num_seqs, valid=None):
        first, nxt = links(idx, num_seqs, valid)
        n = len(nxt)
        return first, torch.where(first[:n] >= 0, first[:n], nxt)    # on rejection: its first child
    monkeypatch.setattr(vt, "_tree_links", below_rejected)
    models = ToyModels(seed=11)
    assert chi2_pvalue(generate(models, "onehot", seed=1), models.exact(), N) < ALPHA


def reference_greedy(parents, tokens, argmax_rows):
    """Walk from the root: the first child matching the argmax, until none does."""
    kids, node, path = children(parents), -1, []
    while True:
        want = argmax_rows[node + 1]
        nxt = next((c for c in kids[node + 1] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def test_greedy_matches_the_reference_walk():
    rng = np.random.default_rng(3)
    trees, argmax_rows = [], []
    for _ in range(300):
        par = random_shape(rng)
        toks = [0] * len(par)
        for kids in children(par):
            distinct = rng.permutation(VOCAB)
            for rank, c in enumerate(kids):
                toks[c] = int(distinct[rank % VOCAB])
        trees.append((par, toks))
        argmax_rows.append([int(rng.integers(0, 3)) for _ in range(len(par) + 1)])   # 3 of 5: many matches
    ids = torch.tensor([t for _, toks in trees for t in toks])
    cu = torch.tensor([0] + list(np.cumsum([len(p) for p, _ in trees])))
    parents = torch.tensor([p for par, _ in trees for p in par])
    argmax = torch.tensor([a for rows in argmax_rows for a in rows])
    logits = torch.nn.functional.one_hot(argmax, VOCAB).double()
    for res in (verify_tree_greedy(ids, cu, parents, argmax),
                verify_tree(ids, cu, parents, logits, None, torch.ones(len(trees), dtype=torch.bool),
                            torch.rand(len(ids)), torch.rand(len(trees)))):
        for b, ((par, toks), rows) in enumerate(zip(trees, argmax_rows)):
            path, final = reference_greedy(par, toks, rows)
            assert int(res.num_accepted[b]) == len(path)
            assert res.path[b, :len(path)].tolist() == path
            assert res.output_ids[b, :len(path) + 1].tolist() == [toks[j] for j in path] + [final]
            accepted = res.is_accepted[cu[b]:cu[b + 1]].tolist()
            assert accepted == [j in path for j in range(len(par))]


def test_a_single_path_verifies_as_verify_does():
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 0, 5, 1, 4] * 8
    cu = torch.tensor([0] + list(np.cumsum(lengths)))
    n, s = int(cu[-1]), len(lengths)
    ids = torch.randint(0, VOCAB, (n,), generator=gen)
    parents = torch.tensor([p for g in lengths for p in chain(g)], dtype=torch.long)
    p = torch.softmax(torch.randn(n + s, VOCAB, generator=gen, dtype=torch.float64) * 2, dim=-1)
    q = torch.softmax(torch.randn(n, VOCAB, generator=gen, dtype=torch.float64) * 2, dim=-1)
    is_greedy = torch.tensor([b % 3 == 0 for b in range(s)])
    acc_u, smp_u = torch.rand(n, generator=gen, dtype=torch.float64), torch.rand(s, generator=gen, dtype=torch.float64)
    for draft_probs in (None, q):
        want = verify(ids, cu, p, draft_probs, is_greedy, acc_u, smp_u)
        got = verify_tree(ids, cu, parents, p, draft_probs, is_greedy, acc_u, smp_u)
        assert torch.equal(got.num_accepted, want.num_accepted)
        assert torch.equal(got.output_ids, want.output_ids)
        assert torch.equal(got.is_accepted, want.is_accepted)
    want = verify_greedy(ids, cu, p.argmax(-1))
    got = verify_tree_greedy(ids, cu, parents, p.argmax(-1))
    assert torch.equal(got.output_ids, want.output_ids) and torch.equal(got.num_accepted, want.num_accepted)


def test_tree_shape_helpers():
    parents = [-1, -1, 0, 0, 2, 1]
    assert depths(parents) == [1, 1, 2, 2, 3, 2]
    assert path_to(parents, 4) == [0, 2, 4]
    bits = visible_inputs(parents)
    assert bits[0] == 1 and bits[5] == 0b101011       # input 5 = token 4: root, tokens 0, 2, 4
    assert children(parents)[0] == [0, 1] and children(parents)[1] == [2, 3]


@pytest.mark.parametrize("kind", KINDS)
def test_the_walk_of_fixed_tries_draws_what_the_walk_of_live_rows_draws(kind):
    """On a GPU the sampled walk takes every row through as many tries as the largest tree has nodes
    (nothing read back); elsewhere only the walks still going. The same uniforms give the same tokens."""
    models, rng, gen = ToyModels(5), np.random.default_rng(5), torch.Generator().manual_seed(5)
    rows = 400
    trees = [draft_tree(models, [], kind, rng) for _ in range(rows)]
    ids, parents, cu, p_rows, q_entries = [], [], [0], [], []
    for par, toks, q in trees:
        ids += toks
        parents += par
        cu.append(cu[-1] + len(toks))
        p_rows.append(models.target([]))
        p_rows += [models.target([toks[j] for j in path_to(par, i)]) for i in range(len(toks))]
        if q is not None:
            q_entries += [q[i] for i in range(len(toks))]
    draft_probs = None
    if kind == "sparse":
        draft_probs = SparseProbs.from_lists([[(list(np.flatnonzero(r)), list(r[np.flatnonzero(r)]))
                                               for r in q_entries]], "cpu")
    elif kind != "onehot":
        draft_probs = torch.tensor(np.array(q_entries), dtype=torch.float64)
    greedy = torch.rand(rows, generator=gen) < 0.2                  # a few greedy rows among the sampled
    args = (torch.tensor(ids), torch.tensor(cu), torch.tensor(parents), torch.tensor(np.array(p_rows)), draft_probs,
            greedy, torch.rand(len(ids), generator=gen, dtype=torch.float64),
            torch.rand(rows, generator=gen, dtype=torch.float64))
    live = verify_tree(*args)
    fixed = verify_tree(*args, tries=max(len(t[0]) for t in trees))
    assert torch.equal(live.num_accepted, fixed.num_accepted) and torch.equal(live.output_ids, fixed.output_ids)
    assert torch.equal(live.path, fixed.path) and torch.equal(live.is_accepted, fixed.is_accepted)
    assert 0 < int(live.num_accepted.sum()) and int((live.num_accepted < 3).sum()) > 0
