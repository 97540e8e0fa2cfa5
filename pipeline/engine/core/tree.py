"""Token trees: several candidate continuations of one row, drafted together and verified in one
forward. Torch-free: the shape of a tree as plain lists, what the layout and the drafters need.

A row's tree is its draft tokens listed so that every token comes after its parent:

  parents[i]  the index of token i's parent among the row's draft tokens, or -1 where token i
              continues the committed text directly (a child of the *root*, the round's first input:
              the last committed token)
  depth       1 for the root's children, 1 + the parent's depth below; a token's RoPE position is
              the row's start (the root's position) plus its depth
  input       the forward's tokens of a row: the root, then the draft tokens in order (input i + 1 is
              draft token i); its KV is written at start + input index, whatever the depth
  visible     the inputs a token attends to besides the committed prefix: the root, its ancestors and
              itself, as bits of one integer (bit j: input j); at most MAX_INPUTS inputs per row
  path        a root child, its child, ... down to one token: what the verifier accepts
  siblings    tokens with the same parent; the verifier tries them in index order

A single path is the tree whose parents are -1, 0, 1, ... (`is_chain`).
"""
from __future__ import annotations

from ..config import MAX_TREE_TOKENS

MAX_INPUTS = MAX_TREE_TOKENS + 1   # a row's inputs (root + draft tokens): their visibility bits fit one
                                   # non-negative int64


def chain(n: int) -> list[int]:
    """The parents of a single path of n tokens."""
    return list(range(-1, n - 1))


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def check(parents: list[int]) -> None:
    """Raise ValueError unless `parents` is a tree in the module's order, within MAX_TREE_TOKENS."""
    if len(parents) > MAX_TREE_TOKENS:
        raise ValueError(f"token tree of {len(parents)} tokens: at most {MAX_TREE_TOKENS}")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"token tree: parent {p} of token {i} is not -1 or an earlier token")


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def visible_inputs(parents: list[int]) -> list[int]:
    """Per input (root first), the bits of the inputs it attends to within the row (module docstring),
    each below 2 ** MAX_INPUTS."""
    bits = [1]
    for i, p in enumerate(parents):
        bits.append(bits[p + 1] | (1 << (i + 1)))
    return bits


def path_to(parents: list[int], node: int) -> list[int]:
    """The tokens from a root child down to `node` (-1: the empty path)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def path_tokens(parents: list[int], drafts: list[int]) -> list[list[int]]:
    """Per input of a row (the root first), the draft tokens of its path, its own included (a single
    path: the drafts up to it): what penalties count as generated this round before the token the
    input's distribution is for."""
    paths: list[list[int]] = [[]]
    for i, p in enumerate(parents):
        paths.append(paths[p + 1] + [drafts[i]])
    return paths


def children(parents: list[int]) -> list[list[int]]:
    """children[j + 1]: the tokens whose parent is j (children[0]: the root's), in index order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def num_leaves(parents: list[int]) -> int:
    """Paths from the root to a leaf (1 for a single path of at least one token, 0 for none)."""
    has_child = set(parents)
    return sum(1 for i in range(len(parents)) if i not in has_child)
