"""The fixed-shape verify tail (core/verify_step.py) gives the eager rule's result token for token: the
same logits laid out padded (R rows of Q positions, pad rows, pad draft positions) and ragged, the same
uniforms, grammar masks and q; the eager side is sampling.row processing + verify_rule.verify_drafts over
the real rows, as the engine runs it after a forward.

Pad positions are set up to be accepted if the tail ignored each row's real draft count: their draft
id is 0 and their logits put token 0 on top.
"""
from types import SimpleNamespace

import pytest
import torch

from pipeline.engine import SamplingParams
from pipeline.engine.core.sampling import RowParams, greedy_tokens, penalty_counts, processed_probs
from pipeline.engine.core.verify import SparseProbs
from pipeline.engine.core.tree import chain, path_tokens
from pipeline.engine.core.verify_rule import verify_drafts
from pipeline.engine.core.verify_step import SlotCounts, Tail, TailSpec, VerifyStep, tail_spec, unpack

VOCAB, WORDS = 96, 3

GREEDY = SamplingParams(temperature=0)
PLAIN = SamplingParams(temperature=0.9)
TOP_K = SamplingParams(temperature=0.7, top_k=5)
NUCLEUS = SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05)
ALL_FILTERS = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)
REPEAT = SamplingParams(temperature=0, repetition_penalty=1.5)
PRESENT = SamplingParams(temperature=0.9, presence_penalty=1.5, frequency_penalty=0.7, top_k=30)
SLOTS = 10


def _case(seed: int, rows: int, q: int, params: list[SamplingParams], grammar: bool, q_form: str,
          tree: bool = False):
    """A padded step's logits and host data; q_form: one-hot, dense or sparse (a support of 6 tokens a row)."""
    dense_q = q_form != "one-hot"
    gen = torch.Generator().manual_seed(seed)
    n = len(params)
    num = [int(torch.randint(0, q, (1,), generator=gen)) for _ in range(n)]
    num[0] = q - 1                                       # one row drafts the most, one none (where n > 1)
    if n > 1:
        num[1] = 0
    logits = torch.randn(rows * q, VOCAB, generator=gen) * 4
    for b in range(rows):                                # pad positions favour token 0, the pad draft id
        for i in range((num[b] if b < n else 0) + 1, q):
            logits[b * q + i, 0] = 50.0
    q_rows = torch.softmax(torch.randn(sum(num), VOCAB, generator=gen) * 2, dim=-1) if dense_q else None
    if q_form == "sparse":
        support = torch.rand(sum(num), VOCAB, generator=gen).argsort(dim=-1)[:, :6]
        q_rows = torch.zeros_like(q_rows).scatter_(1, support, q_rows.gather(1, support))
        q_rows /= q_rows.sum(dim=-1, keepdim=True)
    # trees: each token's parent drawn among the root and the tokens before it (a path: the token before)
    parents = [[int(torch.randint(-1, i, (1,), generator=gen)) if tree else i - 1 for i in range(g)] for g in num]
    if tree and seed % 2:                     # root rows favour token 0 too: a tree's pad tokens are root children
        for b in range(n):
            logits[b * q, 0] = 50.0
    proposals, r = [], 0
    for b, g in enumerate(num):               # drafts: the target's argmax (half), a draw from q, or noise
        row = []
        for i in range(g):
            kind = int(torch.randint(0, 4, (1,), generator=gen))
            if kind < 2:                      # judged against its parent's row: input parent + 1
                row.append(int(logits[b * q + parents[b][i] + 1].argmax()))
            elif dense_q:
                row.append(int(torch.multinomial(q_rows[r + i], 1, generator=gen)))
            else:
                row.append(int(torch.randint(1, VOCAB, (1,), generator=gen)))
        proposals.append(row)
        r += g
    allowed = None
    if grammar:   # about 3 tokens in 4 allowed, token 0 always (no row is empty), and drafts that are the argmax
        bits = lambda: torch.randint(-2**31, 2**31 - 1, (sum(g + 1 for g in num), WORDS), generator=gen,
                                     dtype=torch.int64)
        allowed = bits() | bits() | 1
        r = 0
        for b, row in enumerate(proposals):
            for i, t in enumerate(row):
                judge = parents[b][i] + 1
                if t == int(logits[b * q + judge].argmax()):
                    allowed[r + judge, t // 32] |= 1 << (t % 32)
            r += len(row) + 1
        allowed = allowed.to(torch.int32)
    greedy = all(p.is_greedy for p in params)
    uniforms = None if greedy else (torch.rand(sum(num), generator=gen), torch.rand(n, generator=gen))
    if uniforms is not None:
        for b, p in enumerate(params):                   # greedy rows draw nothing: zeros, as the engine's
            if p.is_greedy:
                start = sum(num[:b])
                uniforms[0][start:start + num[b]] = 0
                uniforms[1][b] = 0
    histories, slots = None, None
    if any(p.has_penalties for p in params):  # histories that share tokens with the drafts and the argmax
        tokens = lambda least: torch.randint(0, VOCAB, (int(torch.randint(least, 12, (1,), generator=gen)),),
                                             generator=gen).tolist()
        histories = [(tokens(1), tokens(0) + proposals[b][1:2]) for b in range(n)]
        slots = torch.randperm(SLOTS, generator=gen)[:n].tolist()
    if q_form == "sparse":                    # every draft in its row's support, then the COO entries
        flat = [t for row in proposals for t in row]
        for i, t in enumerate(flat):
            q_rows[i, t] = max(float(q_rows[i, t]), 0.1)
        q_rows /= q_rows.sum(dim=-1, keepdim=True)
        entry = q_rows.nonzero()
        q_rows = SparseProbs(entry[:, 0], entry[:, 1], q_rows[entry[:, 0], entry[:, 1]])
    return VerifyStep(proposals, params, uniforms, allowed, q_rows, parents if tree else None, histories,
                      slots), logits



def _eager(step: VerifyStep, logits: torch.Tensor, q: int):
    """The rule after a forward: ragged rows, processed (penalties counting each row's history and its
    path's draft tokens), verified: engine._verify_rule."""
    num = step.num_draft
    real = torch.tensor([b * q + i for b, g in enumerate(num) for i in range(g + 1)])
    row_params = [p for p, g in zip(step.params, num) for _ in range(g + 1)]
    rp = RowParams.from_params(row_params, "cpu")
    counts = (None, None)
    if step.histories is not None:
        seqs = [SimpleNamespace(prompt_ids=h[0], output_ids=h[1])
                for h, g in zip(step.histories, num) for _ in range(g + 1)]
        extra = [path for b, row in enumerate(step.proposals)
                 for path in path_tokens(step.parents[b] if step.parents else chain(len(row)), row)]
        counts = penalty_counts(seqs, extra, VOCAB, "cpu")
    ragged = logits[real]
    greedy = [p.is_greedy for p in step.params]
    rows = (greedy_tokens if all(greedy) else processed_probs)(ragged, rp, *counts, allowed=step.allowed)
    cu = torch.tensor([0] + [sum(num[:b + 1]) for b in range(len(num))])
    draft_ids = torch.tensor([t for p in step.proposals for t in p], dtype=torch.long)
    return verify_drafts(draft_ids, cu, num, step.parents, rows, step.draft_probs, greedy, step.uniforms).to_host()


def _tail(step: VerifyStep, logits: torch.Tensor, rows: int, q: int, counts: SlotCounts | None = None):
    spec = tail_spec(step, VOCAB)
    tail = Tail(rows, q, VOCAB, WORDS if step.allowed is not None else 0, spec, "cpu",
                torch.zeros(rows * q, VOCAB), counts or SlotCounts(SLOTS, VOCAB, "cpu"))
    tail.load(tail.host_bytes(step))
    tail.load_q(step)
    tail.run(logits)
    return unpack(tail.out.tolist(), rows, q, step.num_draft, spec.tree), spec


MIXES = {"greedy": [GREEDY] * 3, "plain": [PLAIN] * 3, "top-k": [TOP_K, PLAIN, TOP_K],
         "mixed": [GREEDY, TOP_K, NUCLEUS], "all-filters": [ALL_FILTERS, GREEDY, ALL_FILTERS, NUCLEUS],
         "penalties": [REPEAT, PRESENT, NUCLEUS], "greedy-penalties": [REPEAT, GREEDY, REPEAT]}


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("grammar", [False, True], ids=["free", "grammar"])
@pytest.mark.parametrize("q_form", ["one-hot", "dense", "sparse"])
@pytest.mark.parametrize("rows,q,tree", [(4, 5, False), (8, 3, False), (4, 1, False), (4, 9, True), (8, 6, True)],
                         ids=["4x5", "8x3", "4x1", "4x9-trees", "8x6-trees"])
def test_the_tail_gives_the_eager_rule(mix, grammar, q_form, rows, q, tree):
    accepted = rejected = 0
    for seed in range(12):
        step, logits = _case(seed, rows, q, MIXES[mix], grammar, q_form if q > 1 else "one-hot", tree)
        want = _eager(step, logits, q)
        got, spec = _tail(step, logits, rows, q)
        assert got.num_accepted == want.num_accepted, seed
        assert got.is_accepted == want.is_accepted, seed
        for b, k in enumerate(want.num_accepted):
            assert got.output_ids[b][:k + 1] == want.output_ids[b][:k + 1], (seed, b)
            assert got.output_ids[b][k + 1:] == [-1] * (q - k - 1), (seed, b)
            if tree:
                assert got.path[b][:k] == want.path[b][:k], (seed, b)
        accepted += sum(want.num_accepted)
        rejected += sum(k < g for k, g in zip(want.num_accepted, step.num_draft))
    assert spec.tree == tree
    if q > 1:
        assert accepted > 0 and rejected > 0        # both branches of the rule were taken
    assert spec.grammar == grammar and spec.penalties == ("penalties" in mix)
    assert spec.greedy == {"greedy": "all", "mixed": "some", "all-filters": "some", "penalties": "some",
                           "greedy-penalties": "all"}.get(mix, "none")


def test_the_spec_takes_the_batch_facts_of_the_real_rows():
    step = lambda params, **kw: VerifyStep([[1]] * len(params), params, None, kw.get("allowed"), kw.get("q"))
    assert tail_spec(step([GREEDY, GREEDY]), VOCAB) == TailSpec("all", 0, False, False, False, False)
    assert tail_spec(step([TOP_K, PLAIN]), VOCAB).top_k == VOCAB       # a row without top-k: the full width
    assert tail_spec(step([TOP_K, TOP_K]), VOCAB).top_k == 8           # 5, rounded up to a power of two
    assert tail_spec(step([TOP_K, GREEDY]), VOCAB).top_k == VOCAB      # greedy rows count, as in RowParams
    assert tail_spec(step([NUCLEUS, PLAIN]), VOCAB) == TailSpec("none", 0, True, True, False, False)
    assert tail_spec(step([GREEDY], q=torch.zeros(1, VOCAB)), VOCAB).dense_q is False   # greedy: argmax only
    assert tail_spec(step([SamplingParams(temperature=0.5, repetition_penalty=1.2)]), VOCAB).penalties
    sparse = SparseProbs(torch.tensor([0]), torch.tensor([1]), torch.tensor([1.0]))
    assert tail_spec(step([PLAIN], q=sparse), VOCAB).dense_q            # made dense on the device first


def test_the_top_k_width_changes_nothing_for_rows_below_it():
    """A captured step fixes the top-k width (a power of two at least every row's k): the kept tokens
    are those of each row's own k."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [TOP_K, SamplingParams(temperature=0.7, top_k=3)] * 3
    exact = processed_probs(logits, RowParams.from_params(params, "cpu"))
    cols = torch.tensor([[getattr(p, c) for c in RowParams.COLUMNS] for p in params], dtype=torch.float32).T
    for width in (5, 8, 64, VOCAB):
        wide = processed_probs(logits, RowParams.from_columns(cols, any_greedy=False, top_k_width=width,
                                                              any_top_p=False, any_min_p=False))
        assert torch.equal(wide, exact), width


def test_slot_counts_follow_commits_and_new_sequences():
    """The count tables kept across steps: a row's output grows (only the new tokens are added), a
    slot gets a new sequence (forgotten, then cleared and counted afresh); every step equals the eager
    rule, whose counts come from the full histories."""
    counts = SlotCounts(SLOTS, VOCAB, "cpu")
    rows, q = 4, 5
    step, logits = _case(3, rows, q, [REPEAT, PRESENT, REPEAT], False, "one-hot")
    history = [list(h) for h in step.histories]
    for n in range(5):
        got, _ = _tail(step, logits, rows, q, counts)
        want = _eager(step, logits, q)
        assert (got.num_accepted, got.is_accepted) == (want.num_accepted, want.is_accepted), n
        assert all(g[:k + 1] == w[:k + 1] for g, w, k in zip(got.output_ids, want.output_ids, want.num_accepted)), n
        history[0][1] += want.output_ids[0][:want.num_accepted[0] + 1]          # row 0 commits
        if n == 2:                                                              # slot of row 1: a new sequence
            counts.forget(step.slots[1])
            history[1] = ([7, 7, 8], [9])
        step.histories = [(list(p), list(o)) for p, o in history]
        assert counts.synced[step.slots[0]] == len(step.histories[0][1]) - want.num_accepted[0] - 1
    table = counts.output[step.slots[0], :VOCAB]
    assert table.sum() == len(history[0][1]) - want.num_accepted[0] - 1   # what the last step counted
    assert counts.prompt[step.slots[1], 7] == 2 and counts.prompt[step.slots[1]].sum() == 3
