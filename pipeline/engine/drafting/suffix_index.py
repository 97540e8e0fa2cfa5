"""The suffix indexes that suffix drafting reads (SuffixDecoding, Oliaro et al. 2024, arXiv
2411.04975): a suffix trie bounded in depth (`SuffixTrie`: every substring of at most `max_depth`
tokens of the indexed texts, each node counting its occurrences), in two kinds:

- per request (`RequestIndex`): one sequence's prompt + committed output, only ever appended;
- worker-wide (`SuffixCache`): the texts of the sequences that finished in this worker and, with
  `index_running`, of the running ones, at most `max_cached_tokens` tokens in all.

A draft starts at the node of the longest suffix of the context that continues (`SuffixTrie.match`)
and goes on as a walk (`Match.walk`) or as a token tree over several indexes' matches
(`merged_tree`). Counts estimate; they never change what is accepted.

Plain Python; it knows nothing about sequences, models, verification or rounds.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator

from ..config import SuffixParams, TreeParams
from .trees import DraftTree, grow_tree


class SuffixTrie:
    """Occurrence counts of every substring of at most `max_depth` tokens of the indexed texts.

    Nodes are ints indexing flat lists (node 0 is the root); children maps hold ints only, so
    Python's cyclic garbage collector does not track them (per-node objects made inserts ~6x slower
    through collections alone). Pruned node ids are reused."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.count: list[int] = [0]                     # [node] occurrences of the node's path
        self.children: list[dict[int, int]] = [{}]      # [node] next token -> child node
        self._free: list[int] = []

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self._free)

    def _new(self) -> int:
        if self._free:
            return self._free.pop()
        self.count.append(0)
        self.children.append({})
        return len(self.count) - 1

    def extend(self, open_nodes: list[int], token: int) -> list[int]:
        """Count the occurrences that end at `token` appended to a text whose suffixes of length
        1..max_depth-1 are `open_nodes` (shortest first); returns the new text's open nodes."""
        count, children, grown = self.count, self.children, []
        for node in [0] + open_nodes:                   # hot loop: one node per indexed depth
            child = children[node].get(token)
            if child is None:
                child = children[node][token] = self._new()
            count[child] += 1
            grown.append(child)
        del grown[self.max_depth - 1:]
        return grown

    def add(self, tokens: list[int]) -> None:
        open_nodes: list[int] = []
        for token in tokens:
            open_nodes = self.extend(open_nodes, token)

    def remove(self, tokens: list[int]) -> None:
        """Undo `add(tokens)`: subtract its counts; a node reaching zero is pruned with its subtree
        (whose counts, bounded by its own, reach zero with it: the rest of this walk's path)."""
        count, children = self.count, self.children
        for start in range(len(tokens)):
            node, freed = 0, []
            for token in tokens[start:start + self.max_depth]:
                child = children[node][token]
                count[child] -= 1
                if count[child] == 0:
                    if not freed:
                        del children[node][token]
                    freed.append(child)
                node = child
            for node in freed:
                children[node].clear()
            self._free += freed

    def find(self, pattern: list[int]) -> int | None:
        node, children = 0, self.children
        for token in pattern:
            node = children[node].get(token)
            if node is None:
                return None
        return node

    def _continues(self, node: int, minus: "SuffixTrie | None", minus_node: int | None) -> bool:
        """Whether some token follows `node`'s path in the counts less minus's (continuations, cheaply)."""
        if minus_node is None:
            return bool(self.children[node])
        minus_children, minus_count = minus.children[minus_node], minus.count
        for token, child in self.children[node].items():
            minus_child = minus_children.get(token)
            if minus_child is None or self.count[child] > minus_count[minus_child]:
                return True
        return False

    def longest_match(self, context: list[int], max_len: int,
                      minus: "SuffixTrie | None" = None) -> tuple[int, int | None]:
        """Longest suffix of `context` (at most max_len tokens) that occurs followed by a token (in
        counts less `minus`'s), and its node. A suffix that does implies its shorter suffixes do:
        binary search on the length."""
        lo, hi, best = 0, min(max_len, len(context), self.max_depth - 1), None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            pattern = context[len(context) - mid:]
            node = self.find(pattern)
            minus_node = minus.find(pattern) if minus is not None and node is not None else None
            if node is not None and self._continues(node, minus, minus_node):
                lo, best = mid, node
            else:
                hi = mid - 1
        return lo, best

    def walk(self, node: int, limit: int, min_prob: float, minus: "SuffixTrie | None" = None,
             minus_node: int | None = None, uniforms: list[float] | None = None) -> Walk:
        """A continuation of `node`, at most `limit` tokens, while the running product of each node's
        top share (its most frequent child's count / all its children's) stays >= min_prob; with
        `minus` (minus_node: its node for the same path, None where it lacks the path), counted here
        less minus's counts. Without uniforms, each step takes the most frequent child; with them
        (one per step), each step samples a child in proportion to its count and the walk records
        that distribution (q, for the verifier)."""
        walk, prob = Walk([], 0.0, [] if uniforms is not None else None), 1.0
        while len(walk.tokens) < limit:
            options = self.continuations(node, minus, minus_node)
            if not options:
                break
            total = sum(o[0] for o in options)
            best = max(options, key=lambda o: o[0])                  # the first of the most frequent
            prob *= best[0] / total
            if prob < min_prob:
                break
            if uniforms is None:
                _, token, (node, minus_node) = best
            else:
                _, token, (node, minus_node) = _pick(options, uniforms[len(walk.tokens)] * total)
                walk.q.append(([o[1] for o in options], [o[0] / total for o in options]))
            walk.tokens.append(token)
            walk.score += prob
        return walk

    def continuations(self, node: int, minus: "SuffixTrie | None", minus_node: int | None) -> list[tuple]:
        """(count less minus's, token, (child, minus's child)) of every token that follows `node`."""
        out, count = [], self.count
        minus_children = minus.children[minus_node] if minus_node is not None else None
        for token, child in self.children[node].items():        # hot loop
            n, minus_child = count[child], None
            if minus_children is not None:
                minus_child = minus_children.get(token)
                if minus_child is not None:
                    n -= minus.count[minus_child]
            if n > 0:
                out.append((n, token, (child, minus_child)))
        return out

    def backoff_continuations(self, state: tuple, minus: "SuffixTrie | None") -> list[tuple]:
        """Continuations of a state of several context lengths ((node, minus_node) pairs, longest
        first), as (estimated probability, token, state after it). The longest match often continues
        one way only; a tree then also offers what followed shorter matches. The longest context's
        tokens keep its shares (count / its total T), as its walk estimates them (so the tree's
        likeliest path is the walk); the tokens only shorter contexts saw share 1 / (T + 1) in
        proportion to their counts there (one escape count beside T, as in PPM's method A), so they
        rank below what the longest context saw once and never dilute it. The state after a token:
        the nodes of the contexts that saw it (the tree grows under each token from the longest
        context that saw it)."""
        merged: dict[int, list] = {}
        escape: list[tuple[int, int]] = []
        for level, (node, minus_node) in enumerate(state):
            for n, token, child in self.continuations(node, minus, minus_node):
                if token in merged:
                    merged[token][2].append(child)
                elif level == 0:
                    merged[token] = [n, token, [child]]
                else:
                    merged[token] = [0, token, [child]]
                    escape.append((token, n))
        longest = sum(m[0] for m in merged.values())
        for m in merged.values():
            m[0] /= max(longest, 1)
        if escape:                    # the longest saw nothing (T = 0): the shorter's shares alone
            total = sum(n for _, n in escape)
            for token, n in escape:
                merged[token][0] = n / total / (longest + 1)
        return [(p, token, tuple(children)) for p, token, children in merged.values() if p > 0]

    def match(self, context: list[int], k: int, params: SuffixParams,
              minus: "SuffixTrie | None" = None) -> "Match | None":
        """The node a draft of up to k tokens after `context` starts from; with `minus`, in the counts
        here less minus's (a trie whose texts are all indexed here too). The draft rule: take the
        longest suffix of the context (at least `min_match`, at most max_depth - k tokens, so k draft
        tokens fit under the depth) that occurs followed by some token; from its node a walk
        repeatedly takes the most frequent child. A token's estimated probability is the product of
        count(child) / (sum of the node's children counts) along the walk; the walk stops before it
        falls below `min_prob`, at k tokens (the engine's length) and at floor(max_spec_factor *
        match length) (the Match's limit). The draft's score is the sum of those probabilities (its
        expected accepted length under the index). Token trees also get the nodes of shorter
        matches (half the length, and `min_match`), to back off to (backoff_continuations)."""
        length, node = self.longest_match(context, max(params.min_match, self.max_depth - k), minus)
        if length < params.min_match:
            return None
        minus_node = minus.find(context[len(context) - length:]) if minus is not None else None
        shorter = []                        # token trees back off to shorter matches (backoff_continuations)
        for n in sorted({max(params.min_match, length // 2), params.min_match} - {length}, reverse=True):
            pattern = context[len(context) - n:]
            shorter.append((self.find(pattern), minus.find(pattern) if minus is not None else None))
        return Match(self, node, minus, minus_node, min(k, int(params.max_spec_factor * length + 1e-9)), shorter)

    def draft(self, context: list[int], k: int, params: SuffixParams,
              minus: "SuffixTrie | None" = None) -> tuple[list[int], float]:
        """Up to k most-frequent draft tokens after `context` (`match`, then `walk`), and their score."""
        match = self.match(context, k, params, minus)
        if match is None:
            return [], 0.0
        walk = match.walk(params.min_prob)
        return walk.tokens, walk.score


def _pick(options: list[tuple], target: float) -> tuple:
    """The option whose cumulative count first exceeds target (inverse CDF over counts)."""
    for option in options:
        target -= option[0]
        if target < 0:
            return option
    return options[-1]


@dataclass
class Walk:
    tokens: list[int]                                      # the draft
    score: float                                           # sum of the running top-share products
    q: list[tuple[list[int], list[float]]] | None          # sampled walks: per token, (support, probs)


@dataclass
class Match:
    """Where a draft starts: a node of `trie` (counts less `minus`'s at `minus_node`); a walk goes at
    most `limit` tokens (max_spec_factor's rule), a tree as deep as its caller says."""
    trie: SuffixTrie
    node: int
    minus: SuffixTrie | None
    minus_node: int | None
    limit: int
    shorter: list[tuple[int | None, int | None]]   # trees: nodes of shorter matches (node, minus node)

    def walk(self, min_prob: float, uniforms: list[float] | None = None) -> Walk:
        return self.trie.walk(self.node, self.limit, min_prob, self.minus, self.minus_node, uniforms)

    def state(self) -> tuple:
        """The tree's root state in this index: the match's node and its shorter matches' (backoff)."""
        return ((self.node, self.minus_node), *((n, m) for n, m in self.shorter if n is not None))


def merged_tree(matches: list[Match], max_depth: int, min_prob: float, shape: TreeParams,
                uniforms: Iterator[float] | None = None) -> DraftTree:
    """One tree of at most `max_depth` levels over several indexes' matches, grown best-first by the
    estimated probabilities (drafting/trees.py): a token's estimate is the largest any index gives
    it, and growth under it goes on in every index that saw it (the per-request index offers what
    this text continued with, the worker-wide one what the other sequences did, side by side);
    sampled with `uniforms`. A state: per index, its backoff state or None (that index never saw the
    path)."""
    def continuations(states: tuple) -> list[tuple]:
        merged: dict[int, list] = {}
        for i, (match, st) in enumerate(zip(matches, states)):
            if st is None:
                continue
            for prob, token, after in match.trie.backoff_continuations(st, match.minus):
                entry = merged.setdefault(token, [0.0, [None] * len(matches)])
                entry[0] = max(entry[0], prob)
                entry[1][i] = after
        return [(prob, token, tuple(after)) for token, (prob, after) in merged.items()]
    return grow_tree(tuple(m.state() for m in matches), continuations, max_depth, shape.max_tokens,
                     shape.max_branches, min_prob, uniforms)


class RequestIndex(SuffixTrie):
    """One sequence's trie, grown token by token as its history is committed."""

    def __init__(self, max_depth: int):
        super().__init__(max_depth)
        self.num_tokens = 0
        self._open: list[int] = []

    def append(self, tokens: list[int]) -> None:
        for token in tokens:
            self._open = self.extend(self._open, token)
        self.num_tokens += len(tokens)


@dataclass
class _Running:
    tokens: list[int]        # a running sequence's text indexed so far
    open_nodes: list[int]    # its open nodes in the trie (SuffixTrie.extend)


class SuffixCache:
    """The worker-wide trie: finished sequences, oldest out first, and running sequences' texts as
    they grow (`extend`; with index_running, as SuffixDecoding's global tree takes active responses:
    two samples of one prompt running side by side draft from each other); at most `max_tokens`
    tokens in all. The oldest finished text is evicted first, its counts subtracted and nodes that
    reach zero pruned, so memory stays bounded under a long job (at most tokens * max_depth nodes).
    Running texts are keyed by any hashable (the drafter uses the Sequence)."""

    def __init__(self, max_depth: int, max_tokens: int):
        self.trie, self.max_tokens = SuffixTrie(max_depth), max_tokens
        self.num_tokens = 0                             # indexed tokens, finished and running
        self.num_running_tokens = 0
        self._texts: deque[list[int]] = deque()         # finished texts, oldest first
        self._running: dict[object, _Running] = {}
        self._left: set[object] = set()                 # running keys that found the cap full of running texts

    @property
    def num_sequences(self) -> int:
        return len(self._texts)

    def _make_room(self, num: int) -> None:
        """Evict the oldest finished texts until `num` more tokens fit (the caller checked that the
        running texts leave room for them)."""
        while self._texts and self.num_tokens + num > self.max_tokens:
            old = self._texts.popleft()
            self.trie.remove(old)
            self.num_tokens -= len(old)

    def add(self, tokens: list[int]) -> None:
        """Index a finished text (its last tokens that fit beside the running texts), evicting the
        oldest finished ones to make room."""
        room = self.max_tokens - self.num_running_tokens
        tokens = list(tokens[len(tokens) - room:]) if room > 0 else []
        if not tokens:
            return
        self._make_room(len(tokens))
        self.trie.add(tokens)
        self._texts.append(tokens)
        self.num_tokens += len(tokens)

    def extend(self, key, tokens: list[int]) -> None:
        """Append committed tokens to running text `key` (the first call starts it). Where the cap is
        full of running texts, `key` leaves the index until `finish`."""
        if not tokens or key in self._left:
            return
        run = self._running.setdefault(key, _Running([], []))
        if self.num_running_tokens + len(tokens) > self.max_tokens:
            del self._running[key]
            self.trie.remove(run.tokens)
            self.num_tokens -= len(run.tokens)
            self.num_running_tokens -= len(run.tokens)
            self._left.add(key)
            return
        self._make_room(len(tokens))
        for token in tokens:
            run.open_nodes = self.trie.extend(run.open_nodes, token)
        run.tokens += tokens
        self.num_tokens += len(tokens)
        self.num_running_tokens += len(tokens)

    def is_indexed(self, key) -> bool:
        """Whether running text `key` is in the trie (all of what `extend` was given)."""
        return key in self._running

    def finish(self, key, tokens: list[int]) -> None:
        """Running text `key` ended as `tokens` (its whole text): it becomes the newest finished text."""
        if key in self._running:
            self.extend(key, tokens[len(self._running[key].tokens):])
        run = self._running.pop(key, None)
        self._left.discard(key)
        if run is None:
            self.add(tokens)
        else:
            self.num_running_tokens -= len(run.tokens)
            self._texts.append(run.tokens)
