"""Growing a token tree (core/tree.py) best-first from an index's continuation counts: the shared
part of the suffix and n-gram drafters' trees.

Each tree token carries its *estimated path probability*: the product, along its path, of each
token's estimated probability given its parent (the index's share: its count over the parent's
continuations' counts). Growth pops the likeliest candidate, adds
it, and offers its `max_branches` most frequent continuations as candidates, until `max_tokens`
tokens, the depth limit, or a candidate below `min_prob`. The tokens come out in the order they were
added: parents before children, siblings likeliest first, and path probabilities non-increasing,
so the first n tokens of a tree are the best tree of n tokens by the estimate (what the engine's
tree sizing relies on) and its siblings are verified likeliest first. A tree of one token per
level is the single path the drafter would draft anyway.

Every token is one-hot: the tree is a function of the index and the prefix, never of a draw.

It knows nothing about tries, n-grams, models or verification: an index is reached through a
callable that lists a state's continuations.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Hashable

# a state's continuations: (estimated probability given the state, token, the state after it)
Continuations = Callable[[Hashable], list[tuple[float, int, Hashable]]]


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]     # core/tree.py
    probs: list[float]     # estimated path probability per token, non-increasing

    @property
    def score(self) -> float:
        """Expected accepted tokens under the estimate (each token is accepted with its path's probability)."""
        return sum(self.probs)


def grow_tree(root, continuations: Continuations, max_depth: int, max_tokens: int, max_branches: int,
              min_prob: float) -> DraftTree:
    tree = DraftTree([], [], [])
    heap: list[tuple[float, int, int, int, object, int]] = []   # (-prob, order, parent, token, state, depth)
    order = 0

    def offer(state, parent: int, prob: float, depth: int) -> None:
        nonlocal order
        if depth > max_depth:
            return
        for share, token, child in sorted(continuations(state), key=lambda o: -o[0])[:max_branches]:
            p = prob * share
            if p >= min_prob:
                heapq.heappush(heap, (-p, order, parent, token, child, depth))
                order += 1

    offer(root, -1, 1.0, 1)
    while heap and len(tree.tokens) < max_tokens:
        neg, _, parent, token, state, depth = heapq.heappop(heap)
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.probs.append(-neg)
        offer(state, len(tree.tokens) - 1, -neg, depth + 1)
    return tree
