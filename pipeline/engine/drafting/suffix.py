"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975): drafts from what the text
so far, and what finished earlier in this worker, continued with after the same tokens.

Two indexes of one kind, a suffix trie bounded in depth (`SuffixTrie`: every substring of at most
`max_depth` tokens of the indexed text, each node counting its occurrences):

- per request (`RequestIndex`): the sequence's own prompt + committed output, extended as tokens are
  committed (only ever appended: drafts are not committed);
- worker-wide (`SuffixCache`): prompt + output of the sequences that finished in this worker and,
  with `index_running` (the default, as SuffixDecoding's global tree takes active responses), of
  the running ones too, extended as their tokens are committed: two samples of one prompt running
  side by side draft from each other. At most `max_cached_tokens` tokens in all; the oldest finished
  sequence is evicted first, its counts subtracted and nodes that reach zero pruned, so memory stays
  bounded under a long job (at most tokens * max_depth nodes). A running sequence that finds the cap
  full of running sequences leaves the index until it finishes (then it joins as a finished one).

Draft rule, per index: take the longest suffix of the sequence's tokens (at least `min_match`, at most
max_depth - k tokens, so k draft tokens fit under the depth) that occurs followed by some token; from
its node, repeatedly take the most frequent child. A token's estimated probability is the product of
count(child) / (sum of the node's children counts) along the walk; stop before it falls below
`min_prob`, at k tokens (the engine's length) and at floor(max_spec_factor * match length). The
draft's score is the sum of those probabilities (its expected accepted length under the index);
the per-request and worker-wide drafts compete on score, the per-request one winning ties. A running
sequence's own text is subtracted from the worker-wide counts when it looks up (its per-request trie
holds exactly that text), so the worker-wide draft is what the *other* sequences continued with.

Sampled drafts (`sample_method` probabilistic, the default, for sequences that sample): the winning
index's walk is taken again from the same node, each step now drawing a child in proportion to its
count (one uniform per step from the sequence's draft generator) and stopping by the same running
top-share rule. The draft then comes with q: at each step, the counts normalised over the node's
children. The verifier accepts y with probability min(1, p(y) / q(y)) and resamples from
norm([p - q]+), exact for any q (core/verify.py), so this is lossless like a one-hot draft; it gains where
the target itself spreads over continuations the index has seen (several samples of one templated
prompt): acceptance is then sum_y min(p(y), q(y)) instead of p(most frequent y). Greedy sequences
keep the most-frequent walk, one-hot q.

Token trees (`drafting.tree.max_tokens` > 0): instead of one walk, a tree is grown best-first from
both indexes' matches at once by the same estimated probabilities (drafting/trees.py), at most
`tree.max_branches` continuations per token, at most `tree.max_tokens` tokens in any shape, stopping
below min_prob as the walk does. A token either index saw takes the larger of their estimates, and
the tree grows under it in every index that saw it: the per-request index offers what this text
continued with, the worker-wide one what the other sequences did, side by side. Its depth is bounded
by the tree's size and by half the indexed depth (`max_depth` / 2, the rest left to the match), not
by the engine's path length nor by max_spec_factor: where the index is sure, the budget goes deep
(SuffixDecoding's trees), where it is not, wide, and the estimates (min_prob, and the adaptive
policy's per-depth calibration) price depth where the walk's length rule would cut it. Tree tokens
are one-hot by default, for sampled sequences too: a node's children cover the continuations the
index saw, the token accepted there is distributed as the target's whatever the draft, so the
subtree entered is the one under the target's own choice, and the most frequent continuation gets
the deepest. With `tree.sampled`, a sampled sequence's children are drawn from the merged estimates
without replacement and carry q (drafting/trees.py): the first child then takes the largest subtree
and is accepted with probability sum_y min(p(y), q(y)), which beats the most frequent one's p(y)
only where the counts estimate p closely (measured: bench/RESULTS.md, "Token trees"). With
`max_branches` 1 and one index the one-hot tree is the most-frequent walk (where max_spec_factor
does not cut the walk).

The longest match often continues one way only; a tree then also offers what followed shorter
matches of the context (half its length, and `min_match` tokens): the tokens only a shorter context
saw share the weight of one extra count beside the longest's T counts, 1 / (T + 1) (an escape, as in
PPM compression), while the longest's own tokens keep count / T, as the walk estimates them (so the
tree's likeliest path is the walk); the tree grows under each token from the longest context that
saw it. Counts estimate; they never change what is accepted.

The index is plain Python; torch only draws the uniforms. This module knows nothing about models,
verification or rounds.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import SuffixParams, TreeParams
from ..core.request import Sequence
from ..core.verify import SparseProbs
from ..grammar.walk import GuideView
from .base import DraftBatch, FreeDrafter
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
        first), as (estimated probability, token, state after it). The longest context's tokens keep
        its shares (count / its total T), as its walk estimates them; the tokens only shorter contexts
        saw share 1 / (T + 1) in proportion to their counts there (one escape count beside T, as in
        PPM's method A), so they rank below what the longest context saw once and never dilute it. The
        state after a token: the nodes of the contexts that saw it."""
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
        """The node a draft of up to k tokens after `context` starts from, by the module's rule; with
        `minus`, in the counts here less minus's (a trie whose texts are all indexed here too)."""
        length, node = self.longest_match(context, max(params.min_match, self.max_depth - k), minus)
        if length < params.min_match:
            return None
        minus_node = minus.find(context[len(context) - length:]) if minus is not None else None
        shorter = []                        # token trees back off to shorter matches (module docstring)
        for n in sorted({max(params.min_match, length // 2), params.min_match} - {length}, reverse=True):
            pattern = context[len(context) - n:]
            shorter.append((self.find(pattern), minus.find(pattern) if minus is not None else None))
        return Match(self, node, minus, minus_node, min(k, int(params.max_spec_factor * length + 1e-9)), shorter)

    def draft(self, context: list[int], k: int, params: SuffixParams,
              minus: "SuffixTrie | None" = None) -> tuple[list[int], float]:
        """Up to k most-frequent draft tokens after `context` (`match`, then `walk`), and their score."""
        found = self.match(context, k, params, minus)
        if found is None:
            return [], 0.0
        walk = found.walk(params.min_prob)
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
    """One tree of at most `max_depth` levels over several indexes' matches (module docstring): a
    token's estimate is the largest any index gives it, and growth under it goes on in every index
    that saw it; sampled with `uniforms` (drafting/trees.py). A state: per index, its backoff state
    or None (that index never saw the path)."""
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
    they grow (`extend`); at most `max_tokens` tokens in all. Running texts are keyed by any hashable
    (the drafter uses the Sequence)."""

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


class SuffixDrafter(FreeDrafter):
    """Suffix drafts from the sequence's own history and the worker's other sequences. Owns one
    RequestIndex per running sequence, synchronised with its committed tokens on commit (and on
    propose) together with its running text in the worker-wide cache (index_running), dropped on
    release, when the finished sequence joins the worker-wide cache."""
    kind = "suffix"

    def __init__(self, params: SuffixParams = SuffixParams(), device="cpu", tree: TreeParams = TreeParams()):
        self.params, self.device, self.tree = params, device, tree
        self.cache = SuffixCache(params.max_depth, params.max_cached_tokens)
        self._own: dict[Sequence, RequestIndex] = {}

    def _synced(self, seq: Sequence) -> RequestIndex:
        own = self._own.get(seq)
        if own is None:
            own = self._own[seq] = RequestIndex(self.params.max_depth)
        if own.num_tokens < seq.num_tokens:
            new = seq.all_ids()[own.num_tokens:]
            own.append(new)
            if self.params.index_running:
                self.cache.extend(seq, new)
        return own

    def on_commit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._synced(seq)

    def release(self, seq: Sequence) -> None:
        self._own.pop(seq, None)
        self.cache.finish(seq, seq.all_ids())

    def lookup(self, seq: Sequence, k: int, generator: torch.Generator | None = None,
               ahead: list[int] = ()) -> Walk:
        """Up to k draft tokens for `seq` (after its tokens and then `ahead`, forced tokens already
        proposed): the better-scoring of its own index's and the worker-wide index's most-frequent
        walks; sampled from the winner's counts (with q) where the sequence samples and
        sample_method is probabilistic."""
        empty = Walk([], 0.0, None)
        if k <= 0:
            return empty
        own = self._synced(seq)
        context = (seq.all_ids() + list(ahead))[-self.params.max_depth:]
        best = own.match(context, k, self.params)
        walk = best.walk(self.params.min_prob) if best is not None else empty
        if self.cache.num_tokens:
            minus = own if self.cache.is_indexed(seq) else None           # its own text: counted in `own`
            other = self.cache.trie.match(context, k, self.params, minus)
            if other is not None:
                other_walk = other.walk(self.params.min_prob)
                if other_walk.score > walk.score:
                    best, walk = other, other_walk
        if walk.tokens and self.params.sample_method == "probabilistic" and not seq.params.is_greedy:
            walk = best.walk(self.params.min_prob, torch.rand(best.limit, generator=generator).tolist())
        return walk

    def lookup_tree(self, seq: Sequence, size: int, generator: torch.Generator | None = None,
                    ahead: list[int] = ()) -> DraftTree:
        """A token tree of at most `size` tokens (and tree.max_tokens) for `seq` after its tokens and
        `ahead`, over its own index and the worker-wide one (module docstring); drawn from `generator`
        where the sequence samples and trees are sampled."""
        if size <= 0:
            return DraftTree([], [], [])
        own = self._synced(seq)
        context = (seq.all_ids() + list(ahead))[-self.params.max_depth:]
        depth = min(size, self.params.max_depth // 2)        # half the indexed depth is left to the match
        found = [own.match(context, depth, self.params)]
        if self.cache.num_tokens:
            found.append(self.cache.trie.match(context, depth, self.params,
                                               own if self.cache.is_indexed(seq) else None))
        found = [m for m in found if m is not None]       # trees: deep as `depth`, not as a walk's limit
        if not found:
            return DraftTree([], [], [])
        uniforms = None
        if self.tree.sampled and not seq.params.is_greedy:   # one uniform per draw: at most max_branches
                                                              # per token and the root
            draws = (self.tree.max_tokens + 1) * self.tree.max_branches
            uniforms = iter(torch.rand(draws, generator=generator).tolist())
        shape = TreeParams(min(size, self.tree.max_tokens), self.tree.max_branches, self.tree.sampled)
        return merged_tree(found, depth, self.params.min_prob, shape, uniforms)

    def propose(self, seqs: list[Sequence], lengths: list[int], generators,
                guide: GuideView | None = None) -> DraftBatch:
        if self.tree.max_tokens:
            trees = [self.lookup_tree(s, g, gen, guide.ahead(b) if guide else ())
                     for b, (s, g, gen) in enumerate(zip(seqs, lengths, generators))]
            return DraftBatch.from_lists([t.tokens for t in trees], self.device, _sparse_q(trees, self.device),
                                         [t.parents for t in trees], [t.plan for t in trees])
        walks = [self.lookup(s, g, gen, guide.ahead(b) if guide else ())
                 for b, (s, g, gen) in enumerate(zip(seqs, lengths, generators))]
        return DraftBatch.from_lists([w.tokens for w in walks], self.device, _sparse_q(walks, self.device))


def _sparse_q(drafts: list[Walk] | list[DraftTree], device) -> SparseProbs | None:
    """q of a batch of walks or trees: their own where sampled, one-hot rows elsewhere; None where
    every draft is one-hot."""
    if all(d.q is None for d in drafts):
        return None
    rows = [d.q if d.q is not None else [([t], [1.0]) for t in d.tokens] for d in drafts]
    return SparseProbs.from_lists(rows, device)
