"""Growing a token tree (core/tree.py) best-first from an index's continuation counts: the shared
part of the suffix and n-gram drafters' trees.

Each tree token carries its *estimated path probability*: the product, along its path, of each
token's estimated probability given its parent (the index's share: its count over the parent's
continuations' counts). The tokens come out parents before children, siblings likeliest first (so
verified in that order) and path probabilities non-increasing, so the first n tokens of a tree are
the best tree of n tokens by the estimate (what the engine's tree sizing relies on). One-hot trees
(the default, and every greedy row) are a function of the index and the prefix; sampled trees
(`drafting.tree.sampled`) draw each parent's children without replacement, carry q, and are sized
by their one-hot `twin`: grow_tree states the exactness rule this keeps.

It knows nothing about tries, n-grams, models or verification: an index is reached through a
callable that lists a state's continuations.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator

# a state's continuations: (estimated probability given the state, token, the state after it)
Continuations = Callable[[Hashable], list[tuple[float, int, Hashable]]]


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]     # core/tree.py
    probs: list[float]     # estimated path probability per token, non-increasing
    q: list[tuple[list[int], list[float]]] | None = None   # sampled trees: per token, the (support, probs)
                                                           # it was drawn from; None: every token one-hot
    twin: "DraftTree | None" = None   # sampled trees: the one-hot tree of the same lookup (grow_tree)

    @property
    def plan(self) -> "DraftTree":
        """The draw-free tree whose estimates size this one: itself when one-hot, else its twin."""
        return self if self.twin is None else self.twin

    @property
    def score(self) -> float:
        """Expected accepted tokens under the estimate (each token is accepted with its path's probability)."""
        return sum(self.probs)


def grow_tree(root, continuations: Continuations, max_depth: int, max_tokens: int, max_branches: int,
              min_prob: float, uniforms: Iterator[float] | None = None) -> DraftTree:
    """The tree from `root`: one-hot, or sampled with one uniform per draw from `uniforms` (then with
    its one-hot twin). Growth pops the likeliest candidate, adds it, and offers its `max_branches`
    most frequent continuations as candidates, until `max_tokens` tokens, the depth limit, or a
    candidate below `min_prob`. A tree of one token per level is the single path the drafter would
    draft anyway.

    One-hot (`uniforms` None): each parent's children are its `max_branches` most frequent
    continuations. Sampled (a sampled row's `uniforms`, one per draw, from its draft generator): a
    parent's children are drawn from its continuations *without replacement*, each in proportion to
    the estimates left after the siblings drawn before it, and each carries that distribution as its
    q (support, probabilities) for the verifier (core/verify_tree.py: a sibling's q may depend on
    the earlier siblings, as long as it is the distribution the sibling was drawn from). A parent
    gets as many children as its one-hot tree would, and the j-th drawn child takes the j-th largest
    estimate as its own, so siblings stay listed in the order they were drawn and any first n tokens
    keep them in that order; the subtree under a child grows from the token drawn. The first child,
    which gets the deepest subtree, is then accepted with probability sum_y min(p(y), q(y)) =
    1 - TV(p, q) rather than p(most frequent y): it pays only where the counts estimate the target's
    distribution that closely (drafting/suffix.py).

    The exactness rule: whether a draft position exists, and the q it is drawn from, may depend on
    the committed prefix and on draws the verifier judges before it (its ancestors, the siblings
    drawn before it and what grew under them), or on draws independent of its own given its
    ancestors (what grew under its ancestors' later siblings); never on its own draw, the siblings
    drawn after it (drawn without replacement, they tell which token it is) or its descendants.
    Otherwise a position exists more often for some tokens than for others, and the accepted tokens
    are no longer distributed as the target's. Best-first growth keeps the rule: a token is added
    before its later siblings' and its own subtrees are offered. Choosing how many tokens to keep
    from the estimates of the drawn tokens would break it (a subtree's estimates are those of the
    token drawn at its root), so a sampled tree comes with its `twin`, the one-hot tree of the same
    lookup (a function of the index and the prefix alone), and a tree is sized by its twin's
    estimates (the engine's adaptive sizing); its first n tokens are then the sampled tree grown to
    n tokens."""
    tree = DraftTree([], [], [], [] if uniforms is not None else None)
    if uniforms is not None:
        tree.twin = grow_tree(root, continuations, max_depth, max_tokens, max_branches, min_prob)
    heap: list[tuple] = []       # (-prob, order, parent, token, state, depth, q)
    order = 0

    def offer(state, parent: int, prob: float, depth: int) -> None:
        nonlocal order
        if depth > max_depth:
            return
        options = sorted(continuations(state), key=lambda o: -o[0])
        ranks = [prob * share for share, _, _ in options[:max_branches]]
        ranks = ranks[:sum(1 for p in ranks if p >= min_prob)]          # non-increasing: a prefix
        picks = options[:len(ranks)] if uniforms is None else _draw(options, len(ranks), uniforms)
        for p, (_, token, child, *q) in zip(ranks, picks):
            heapq.heappush(heap, (-p, order, parent, token, child, depth, q[0] if q else None))
            order += 1

    offer(root, -1, 1.0, 1)
    while heap and len(tree.tokens) < max_tokens:
        neg, _, parent, token, state, depth, q = heapq.heappop(heap)
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.probs.append(-neg)
        if tree.q is not None:
            tree.q.append(q)
        offer(state, len(tree.tokens) - 1, -neg, depth + 1)
    return tree


def _draw(options: list[tuple], n: int, uniforms: Iterator[float]) -> list[tuple]:
    """n continuations drawn without replacement, each in proportion to the estimates left (one
    uniform per draw, inverse CDF in `options`' order), each as (share, token, state, its q)."""
    left, out = list(options), []
    for _ in range(min(n, len(left))):
        total = sum(o[0] for o in left)
        q = ([o[1] for o in left], [o[0] / total for o in left])
        target, pick = next(uniforms) * total, len(left) - 1
        for i, o in enumerate(left):
            target -= o[0]
            if target < 0:
                pick = i
                break
        out.append((*left.pop(pick), q))
    return out
