"""Token trees on the drafting side: best-first growth (drafting/trees.py), the suffix and n-gram
drafters' trees, a batch of trees cut to size, and the adaptive policy's tree sizing."""
import pytest
import torch

from pipeline.engine import SamplingParams, SuffixParams, TreeParams
from pipeline.engine.core.request import Sequence
from pipeline.engine.core.tree import check, children, depths
from pipeline.engine.drafting.adaptive import TREE_PRIOR, AdaptiveDraftLength
from pipeline.engine.drafting.cost import CostModel
from pipeline.engine.core.verify import SparseProbs
from pipeline.engine.drafting.base import DraftBatch
from pipeline.engine.drafting.ngram import NgramDrafter
from pipeline.engine.drafting.suffix import SuffixDrafter
from pipeline.engine.drafting.trees import DraftTree, grow_tree

# a toy index: state = path; after () come 7 (6 times), 8 (3), 9 (1); after any path of length 1-3,
# its last token + 1 (4 times) or + 2 (1 time)
def toy(path):
    if not path:
        return [(0.6, 7, (7,)), (0.3, 8, (8,)), (0.1, 9, (9,))]
    return [(0.8, path[-1] + 1, path + (path[-1] + 1,)), (0.2, path[-1] + 2, path + (path[-1] + 2,))]


def test_growth_is_best_first_and_bounded():
    tree = grow_tree((), toy, max_depth=3, max_tokens=8, max_branches=2, min_prob=0.05)
    check(tree.parents)
    assert len(tree.tokens) == 8
    assert tree.probs == sorted(tree.probs, reverse=True)
    # 7 (0.6), then its likeliest child 8 (0.6 * 0.8), then that one's 9 (0.384) before the root's 8 (0.3)
    assert tree.tokens[:3] == [7, 8, 9] and tree.parents[:3] == [-1, 0, 1]
    assert tree.probs[:3] == [pytest.approx(0.6), pytest.approx(0.48), pytest.approx(0.384)]
    assert [tree.tokens[i] for i in children(tree.parents)[0]] == [7, 8], "at most max_branches children"
    assert max(depths(tree.parents)) <= 3
    assert all(len(kids) <= 2 for kids in children(tree.parents))
    path = grow_tree((), toy, max_depth=3, max_tokens=8, max_branches=1, min_prob=0.05)
    assert path.tokens == [7, 8, 9] and path.parents == [-1, 0, 1]           # one branch: the likeliest walk
    assert grow_tree((), toy, 3, 8, 3, min_prob=0.5).tokens == [7]           # path probability 0.48 < 0.5


def seq(tokens, rid="s"):
    s = Sequence(rid, tokens, SamplingParams(temperature=0), 0)
    return s


def test_suffix_tree_with_one_branch_is_the_walk():
    text = [1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 1, 2, 3, 4, 5, 1, 2]
    params = dict(min_match=1, max_spec_factor=4.0, max_cached_tokens=0)
    walk = SuffixDrafter(SuffixParams(sample_method="greedy", **params)).lookup(seq(text), 4)
    tree = SuffixDrafter(SuffixParams(**params),
                         tree=TreeParams(max_tokens=8, max_branches=1)).lookup_tree(seq(text), 4)
    assert tree.tokens == walk.tokens and tree.parents == list(range(-1, len(walk.tokens) - 1))


def test_suffix_tree_offers_the_other_continuations():
    text = [9, 1, 2, 3, 4, 8, 1, 2, 3, 4, 7, 1, 2, 3, 6, 5, 1, 2, 3]     # the longest match: 1 2 3
    drafter = SuffixDrafter(SuffixParams(min_match=1, min_prob=0.05, max_cached_tokens=0),
                            tree=TreeParams(max_tokens=6, max_branches=3))
    tree = drafter.lookup_tree(seq(text), 3)
    roots = [tree.tokens[i] for i in children(tree.parents)[0]]
    assert roots == [4, 6]                              # after 1 2 3: 4 twice, 6 once, likeliest first
    assert tree.probs[:2] == [pytest.approx(2 / 3), pytest.approx(1 / 3)]
    batch = drafter.propose([seq(text)], [3], [None])
    assert batch.is_tree and batch.proposals[0] == tree.tokens and batch.plans[0].probs == tree.probs


def test_sampled_suffix_trees_only_where_configured_and_the_row_samples():
    text = [9, 1, 2, 3, 4, 8, 1, 2, 3, 4, 7, 1, 2, 3, 6, 5, 1, 2, 3]     # after 1 2 3: 4 twice, 6 once
    sampled = Sequence("s", text, SamplingParams(temperature=0.8), 0)
    shape = TreeParams(max_tokens=6, max_branches=3)
    params = SuffixParams(min_match=1, min_prob=0.05, max_cached_tokens=0)
    gen = torch.Generator().manual_seed(0)
    assert SuffixDrafter(params, tree=shape).lookup_tree(sampled, 3, gen).q is None       # the default: one-hot
    drafter = SuffixDrafter(params, tree=TreeParams(max_tokens=6, max_branches=3, sampled=True))
    assert drafter.lookup_tree(seq(text), 3, gen).q is None                              # greedy rows: one-hot
    firsts = set()
    for _ in range(40):
        batch = drafter.propose([sampled, seq(text)], [3, 3], [gen, gen])
        q = batch.draft_probs
        assert int(q.row.max()) + 1 == len(batch.draft_ids)                 # a q row per token, one-hot ones too
        root_q = [(int(t), round(float(p), 3)) for r, t, p in zip(q.row, q.token, q.prob) if r == 0]
        assert sorted(root_q) == [(4, 0.667), (6, 0.333)]
        firsts.add(batch.proposals[0][0])
    assert firsts == {4, 6}, "the first child is drawn, not always the most frequent"


def test_ngram_tree_counts_every_occurrence():
    text = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 8, 1, 2]
    drafter = NgramDrafter(2, 3, tree=TreeParams(max_tokens=6, max_branches=2))
    tree = drafter.lookup_tree(seq(text), 6)
    kids = children(tree.parents)
    assert [tree.tokens[i] for i in kids[0]] == [3, 4]
    three = kids[0][0]
    assert sorted(tree.tokens[i] for i in kids[three + 1]) == [8, 9]
    assert tree.probs[0] == pytest.approx(2 / 3)
    single = NgramDrafter(2, 3).lookup(seq(text), 2)
    assert single == [3, 8]                                       # the latest occurrence's continuation


def test_a_batch_of_trees_cut_to_size():
    plans = [DraftTree([5, 6, 7, 8], [-1, -1, 0, 1], [0.5, 0.4, 0.3, 0.2]), DraftTree([1, 2], [-1, 0], [0.9, 0.8])]
    batch = DraftBatch.from_lists([[5, 6, 7, 8], [1, 2]], "cpu", None, [[-1, -1, 0, 1], [-1, 0]], plans)
    cut = batch.truncated([3, 0])
    assert cut.proposals == [[5, 6, 7], []] and cut.parents == [[-1, -1, 0], []] and cut.num_draft == [3, 0]
    assert [t.probs for t in cut.plans] == [[0.5, 0.4, 0.3], []] and cut.plans[0].parents == [-1, -1, 0]
    path = DraftBatch.from_lists([[1, 2]], "cpu", None, [[-1, 0]], plans[1:])
    assert path.parents is None and path.plans == plans[1:]                 # a path, its plan kept


def test_a_batch_of_sampled_trees_cut_to_size_keeps_each_tokens_q():
    q = [[([5, 6], [0.6, 0.4]), ([6], [1.0]), ([7, 8], [0.5, 0.5]), ([8], [1.0])], [([1, 3], [0.9, 0.1]), ([2], [1.0])]]
    batch = DraftBatch.from_lists([[5, 6, 7, 8], [1, 2]], "cpu", SparseProbs.from_lists(q, "cpu"),
                                  [[-1, -1, 0, 1], [-1, 0]])
    cut = batch.truncated([3, 1])
    assert cut.proposals == [[5, 6, 7], [1]]
    rows = [(int(r), int(t), round(float(p), 3)) for r, t, p in zip(cut.draft_probs.row, cut.draft_probs.token,
                                                                    cut.draft_probs.prob)]
    assert rows == [(0, 5, 0.6), (0, 6, 0.4), (1, 6, 1.0), (2, 7, 0.5), (2, 8, 0.5), (3, 1, 0.9), (3, 3, 0.1)]
    dense = torch.zeros(6, 10)
    dense[torch.arange(6), torch.tensor([5, 6, 7, 8, 1, 2])] = 1.0
    cut = DraftBatch.from_lists([[5, 6, 7, 8], [1, 2]], "cpu", dense, [[-1, -1, 0, 1], [-1, 0]]).truncated([2, 2])
    assert cut.draft_probs.argmax(-1).tolist() == [5, 6, 1, 2]


def test_trees_grafted_under_forced_tokens():
    """Row 0: forced 7 8 ahead, then its tree's tokens 0, 2, 3 kept (the root's second child 1
    dropped): token 0 hangs under 8, tokens 2 and 3 under token 0; row 1: nothing forced, its whole
    tree. q moves with its token and the forced tokens get one-hot rows."""
    q = [[([5, 9], [0.5, 0.5]), ([6], [1.0]), ([7, 4], [0.7, 0.3]), ([8], [1.0])], [([1], [1.0]), ([2], [1.0])]]
    batch = DraftBatch.from_lists([[5, 6, 7, 8], [1, 2]], "cpu", SparseProbs.from_lists(q, "cpu"),
                                  [[-1, -1, 0, 0], [-1, -1]])
    out = batch.grafted([[7, 8], []], [[0, 2, 3], [0, 1]])
    assert out.proposals == [[7, 8, 5, 7, 8], [1, 2]]
    assert out.parents == [[-1, 0, 1, 2, 2], [-1, -1]]
    rows = sorted((int(r), int(t), round(float(p), 2)) for r, t, p in zip(out.draft_probs.row, out.draft_probs.token,
                                                                          out.draft_probs.prob))
    assert rows == [(0, 7, 1.0), (1, 8, 1.0), (2, 5, 0.5), (2, 9, 0.5), (3, 4, 0.3), (3, 7, 0.7), (4, 8, 1.0),
                    (5, 1, 1.0), (6, 2, 1.0)]
    assert not out.one_hot_rows()[0][2] and out.one_hot_rows()[0][0]
    assert batch.one_hot_rows() == [[False, True, False, True], [True, True]]
    dense = torch.zeros(6, 10)
    dense[torch.arange(6), torch.tensor([5, 6, 7, 8, 1, 2])] = 1.0
    dense[2, [7, 4]] = torch.tensor([0.7, 0.3])
    assert DraftBatch.from_lists([[5, 6, 7, 8], [1, 2]], "cpu", dense).one_hot_rows() == [[True, True, False, True],
                                                                                         [True, True]]
    assert DraftBatch.from_lists([[5], []], "cpu").one_hot_rows() == [[True], []]
    path = DraftBatch.from_lists([[5, 6]], "cpu").spliced([[7]], [1], [[9]])       # single paths: spliced
    assert path.proposals == [[7, 5, 9]] and path.draft_probs is None


def test_sampled_children_are_drawn_without_replacement_and_carry_their_q():
    """At the root of `toy` (7: 0.6, 8: 0.3, 9: 0.1) with two children per parent: the first child is
    drawn from the shares, the second from what is left, each with that distribution as q; the tree's
    shape and estimates are the one-hot tree's. Over 20,000 draws the first and second children's
    frequencies pass a chi-square test against those distributions (each fails a correct drawer with
    probability 1e-6), and every child's q leaves out the siblings drawn before it."""
    from references import chi2_pvalue
    import random
    one_hot = grow_tree((), toy, max_depth=3, max_tokens=8, max_branches=2, min_prob=0.05)
    rng, n = random.Random(3), 20_000
    first, pairs = {}, {}
    for _ in range(n):
        tree = grow_tree((), toy, 3, 8, 2, 0.05, uniforms=iter(rng.random() for _ in range(100)))
        check(tree.parents)
        assert tree.parents == one_hot.parents and tree.probs == one_hot.probs
        kids = children(tree.parents)
        for parent_kids in kids:
            tokens = [tree.tokens[i] for i in parent_kids]
            assert len(set(tokens)) == len(tokens), "siblings are distinct"
            for j, i in enumerate(parent_kids):                # q: what was left when child j was drawn
                support, probs = tree.q[i]
                assert not set(support) & set(tokens[:j]) and tree.tokens[i] in support
                assert sum(probs) == pytest.approx(1.0)
        a, b = (tree.tokens[i] for i in kids[0])
        first[(a,)] = first.get((a,), 0) + 1
        pairs[(a, b)] = pairs.get((a, b), 0) + 1
    shares = {7: 0.6, 8: 0.3, 9: 0.1}
    assert chi2_pvalue(first, {(t,): p for t, p in shares.items()}, n) > 1e-6
    exact = {(a, b): shares[a] * shares[b] / (1 - shares[a]) for a in shares for b in shares if a != b}
    assert chi2_pvalue(pairs, exact, n) > 1e-6


def sizing(verify_curve):
    costs = CostModel()
    costs.verify_curve = verify_curve
    policy = AdaptiveDraftLength(4, costs, draft_is_free=True)
    policy.tree_prior = 1.0                  # the estimates taken at their word until rounds say otherwise
    return policy


def test_tree_sizes_follow_the_verify_curve():
    scores = [[0.9, 0.5, 0.3, 0.05], [0.6, 0.2]]
    parents = [[-1, -1, 0, 2], [-1, 0]]
    # flat up to 8 tokens (weight-bound), then steep: every token worth anything until the curve turns
    flat = sizing([(1, 1.0), (8, 1.0), (16, 3.0)])
    assert flat.tree_sizes(scores, parents) == [4, 2]
    # each token costs 0.3 of a 1-token step: rates 2/1.3, 2.9/1.6, 3.5/1.9, 4.0/2.2: the best two only
    steep = sizing([(1, 1.0), (2, 1.3), (3, 1.6), (4, 1.9), (5, 2.2), (6, 2.5), (7, 2.8), (8, 3.1)])
    assert steep.tree_sizes(scores, parents) == [1, 1]
    # a draft never pays at 3x a step per token: no draft at all
    assert sizing([(1, 1.0), (2, 4.0), (8, 22.0)]).tree_sizes(scores, parents) == [0, 0]
    # the calibration scales the estimate: observed depth half the estimate halves every score
    # the calibration scales the estimate: trees whose first token was never accepted shrink
    rejected = sizing([(1, 1.0), (2, 1.3), (3, 1.6), (4, 1.9), (5, 2.2), (6, 2.5), (7, 2.8), (8, 3.1)])
    for _ in range(4):
        rejected.observe_tree([1.0] * 4, [-1, 0, 1, 2], 0)
    assert rejected.tree_calibration[0] == pytest.approx(2 / 6, rel=0.05)    # (0 + 2 * prior) / (~4 + 2)
    assert sum(rejected.tree_sizes(scores, parents)) < 2


def test_tree_sizes_discount_the_depths_an_index_overrates():
    """A one-occurrence chain estimates 1 at every depth; rounds that accept its first token and no more
    teach c_1 ~ 1 and c_2.. ~ 0, so only the first token stays worth its cost."""
    policy = sizing([(1, 1.0), (2, 1.3), (3, 1.6), (4, 1.9), (5, 2.2)])
    chain = [-1, 0, 1, 2]
    assert policy.tree_sizes([[1.0] * 4], [chain]) == [4]                     # taken at its word
    for _ in range(50):
        policy.observe_tree([1.0] * 4, chain, 1)
    c = policy.tree_calibration
    assert c[0] > 0.95 and c[1] < 0.1 and c == sorted(c, reverse=True)
    assert policy.tree_sizes([[1.0] * 4], [chain]) == [1]


def test_tree_calibration_learns_past_its_prior():
    """Under the default prior (half the estimate), rounds that accept every estimated token teach c_d
    ~ 1 at every depth, and then a weight-bound step keeps the whole chain. A calibration capped at its
    prior values each token at half its worth, and sizes such trees to a fraction of what pays."""
    policy = sizing([(1, 1.0), (2, 1.6), (3, 2.2), (4, 2.8), (5, 3.4)])
    policy.tree_prior = TREE_PRIOR
    chain = [-1, 0, 1, 2]
    assert policy.tree_sizes([[1.0] * 4], [chain]) == [0]        # 0.5 per 0.6 of a step: no token pays at first
    for _ in range(50):
        policy.observe_tree([1.0] * 4, chain, 4)
    c = policy.tree_calibration
    assert min(c) > 0.9 and c == sorted(c, reverse=True), c
    assert policy.tree_sizes([[1.0] * 4], [chain]) == [4]


def test_refused_trees_are_retried_once_the_evidence_fades():
    """Rounds that accepted nothing teach c_1 ~ 0.15, below the ~0.31 a token must be worth at batch 4
    when each costs 0.1 of a step. Each refused step decays that evidence towards the prior (0.5), so
    the trees pay again after ln(4.80 / 1.25) / -ln(0.98) ~ 67 refusals; on a curve where even the
    prior cannot pay they stay refused, however long."""
    policy = sizing([(1, 1.0), (64, 7.3)])                      # V(T) = 1 + 0.1 (T - 1)
    policy.tree_prior = TREE_PRIOR
    assert policy.tree_may_pay(4, 16)
    for _ in range(5):
        policy.observe_tree([1.0] * 4, [-1, 0, 1, 2], 0)
    assert not policy.tree_may_pay(4, 16)
    refused = 0
    while not policy.tree_may_pay(4, 16) and refused < 1000:
        policy.forget_trees()
        refused += 1
    assert 60 <= refused <= 75, refused
    never = sizing([(1, 1.0), (2, 4.0), (64, 200.0)])           # a token costs 3 steps
    never.tree_prior = TREE_PRIOR
    for _ in range(5):
        never.observe_tree([1.0] * 4, [-1, 0, 1, 2], 0)
    for _ in range(1000):
        never.forget_trees()
    assert never.tree_calibration[0] == pytest.approx(TREE_PRIOR, abs=1e-3)
    assert not never.tree_may_pay(4, 16) and not never.tree_may_pay(1, 16)


def test_no_tree_pays_only_where_sizing_keeps_nothing():
    """tree_may_pay is a bound: where it says no tree could pay, tree_sizes keeps nothing of any trees
    (path probabilities at most 1, any calibration); it says no at a large batch on a steep curve and
    yes where the step is weight-bound."""
    import random
    rng = random.Random(5)
    closed = 0
    for _ in range(800):
        xs = sorted(rng.sample(range(1, 300), rng.randint(2, 8)))
        ys, y, last = [], rng.uniform(0.5, 2.0), 0                  # flat stretches and steep ones
        for x in xs:
            y += (x - last) * rng.choice([0.0, rng.uniform(0.0, 0.2)])
            ys.append(y)
            last = x
        policy = sizing(list(zip(xs, ys)))
        policy.tree_prior = rng.uniform(0.05, 1.0)
        for _ in range(rng.randint(0, 6)):
            n = rng.randint(1, 5)
            policy.observe_tree([rng.random() for _ in range(n)], list(range(-1, n - 1)), rng.randint(0, n))
        batch, size = rng.randint(1, 40), rng.randint(1, 16)
        trees = []
        for _ in range(batch):
            n = rng.randint(0, size)
            parents = [rng.randint(-1, i - 1) for i in range(n)]
            probs = sorted((rng.random() ** 0.3 for _ in range(n)), reverse=True)
            trees.append((probs, parents))
        if not policy.tree_may_pay(batch, size):
            closed += 1
            assert policy.tree_sizes([t[0] for t in trees], [t[1] for t in trees]) == [0] * batch
    assert 20 < closed < 780, f"the bound closed {closed} of 800 cases"
    steep = [(1, 10.0), (16, 40.0), (32, 68.0), (64, 113.0)]        # a 2-core CPU's bf16 verify curve (ms)
    policy = sizing(steep)
    policy.tree_prior = TREE_PRIOR
    assert not policy.tree_may_pay(16, 16) and policy.tree_may_pay(1, 16)
    policy.tree_prior = 1.0                           # tokens sure to be accepted pay at batch 16 too
    assert policy.tree_may_pay(16, 16)


def test_suffix_tree_holds_both_indexes_continuations():
    """After 1 2 3 this text went on 4 5 6 and another sequence 7 8 9: one tree offers both, each
    grown on in the index that saw it, each at the larger of the indexes' estimates."""
    drafter = SuffixDrafter(SuffixParams(min_match=2, min_prob=0.05), tree=TreeParams(max_tokens=8, max_branches=2))
    other = seq([20, 1, 2, 3, 7, 8, 9, 21], "other")
    drafter.on_commit([other])
    drafter.release(other)                                   # now in the worker-wide index only
    tree = drafter.lookup_tree(seq([1, 2, 3, 4, 5, 6, 30, 31, 1, 2, 3]), 8)
    check(tree.parents)
    kids = children(tree.parents)
    assert sorted(tree.tokens[i] for i in kids[0]) == [4, 7]
    below = lambda token: [tree.tokens[i] for i in kids[tree.tokens.index(token) + 1]]
    assert below(4) == [5] and below(7) == [8] and below(5) == [6] and below(8) == [9]
    assert tree.probs[tree.tokens.index(4)] == tree.probs[tree.tokens.index(7)] == pytest.approx(1.0)
    alone = SuffixDrafter(SuffixParams(min_match=2, min_prob=0.05, max_cached_tokens=0),
                          tree=TreeParams(max_tokens=8, max_branches=2))
    assert 7 not in alone.lookup_tree(seq([1, 2, 3, 4, 5, 6, 30, 31, 1, 2, 3]), 4).tokens


def first_token_law(children: list[tuple[int, dict[int, float]]], p: dict[int, float]) -> dict[int, float]:
    """The law of the token a tree's root emits or moves to (independent of core/verify_tree.py): each
    child (token, the q it was drawn from) in turn is accepted with probability min(1, r(y) / q(y)),
    r <- norm([r - q]+) on rejection; the residual left at the end is drawn from."""
    law, r, left = {}, dict(p), 1.0
    for y, q in children:
        accept = min(1.0, r.get(y, 0.0) / q[y])
        law[y] = law.get(y, 0.0) + left * accept
        left *= 1 - accept
        res = {t: max(r.get(t, 0.0) - q.get(t, 0.0), 0.0) for t in set(r) | set(q)}
        total = sum(res.values())
        r = {t: v / total for t, v in res.items()} if total > 0 else r
    for t, v in r.items():
        law[t] = law.get(t, 0.0) + left * v
    return law


def test_adaptive_sampled_trees_are_sized_by_their_one_hot_twin(target_model):
    """The index offers a: 3, b: 1 after the root; a goes on with c, b with nothing; the target's p is
    a: .5, b: .5. Drawing a first grows [a, c, b] (estimates .75, .75, .25), drawing b first [b, a, c]
    (.75, .25, .25). On the verify curve V(1) = 1, V(2) = V(3) = 1.6, V(4) = 1.7 with c_d = .5, the
    first tree is worth keeping whole and the second not at all: sizing by the drawn estimates emits
    a with probability .75 x 2/3 + .25 x .5 = .625. The engine sizes both by the one-hot twin (the
    first tree's shape whatever was drawn), keeps 3 tokens of either, and a comes out with p's .5."""
    from conftest import make_engine
    a, b, c = 1, 2, 3
    index = {(): [(0.75, a, (a,)), (0.25, b, (b,))], (a,): [(1.0, c, (a, c))]}
    shape = TreeParams(max_tokens=4, max_branches=2, sampled=True)
    engine = make_engine(target_model, "suffix", max_num_seqs=1, max_model_len=64, adaptive=True, tree=shape)
    engine.costs.verify_curve = [(1, 1.0), (2, 1.6), (3, 1.6), (4, 1.7)]
    engine.lengths.policy.tree_prior = 0.5
    law = {}
    for u, chance in ((0.1, 0.75), (0.9, 0.25)):              # the root's first draw: a, then b
        tree = grow_tree((), lambda s: index.get(s, []), 3, 4, 2, 0.1, uniforms=iter([u, 0.5, 0.5, 0.5]))
        assert tree.plan.tokens == [a, c, b] and tree.plan.probs == [0.75, 0.75, 0.25]
        found = DraftBatch.from_lists([tree.tokens], "cpu", SparseProbs.from_lists([tree.q], "cpu"),
                                      [tree.parents], [tree.plan])
        kept = engine.lengths.size_trees(found)
        assert kept.num_draft == [3] and kept.proposals[0] == tree.tokens[:3]
        kids = [(tree.tokens[i], dict(zip(*tree.q[i]))) for i in children(tree.parents)[0]]
        for token, prob in first_token_law(kids, {a: 0.5, b: 0.5}).items():
            law[token] = law.get(token, 0.0) + chance * prob
        drawn = engine.lengths.policy.tree_sizes([tree.probs], [tree.parents])      # the biased rule's size
        assert drawn == ([3] if tree.tokens[0] == a else [0])
    assert law[a] == pytest.approx(0.5) and law[b] == pytest.approx(0.5)
