"""The Drafter protocol: how the engine asks for draft tokens. Proposers never verify.

The engine talks to a drafter only through `Drafter`; it never reads or writes a drafter's
attributes. Implementations: ngram.py (prompt lookup), suffix.py (suffix indexes), draft_model.py (a
small model with its own slot KV store), hybrid.py (a lookup where it matches, the model elsewhere),
and NoDrafter here (draft length 0: plain decoding through the same engine).

Every proposal is returned flat (DraftBatch): token ids of all sequences concatenated, with offsets,
and q where the drafter sampled. This module knows nothing about verification, stops or cost models.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ..core.prefix import Reuse
from ..core.tree import chain, is_chain
from ..core.request import Sequence
from ..core.verify import SparseProbs
from ..grammar.walk import GuideView
from ..model.prefill import Chunk
from ..model.runner import ModelRunner
from .trees import DraftTree


@dataclass
class DraftBatch:
    num_draft: list[int]                 # [num_seqs] proposed tokens per sequence (may be 0)
    draft_ids: torch.Tensor              # [num_draft_tokens] int64, flat
    cu_num_draft: torch.Tensor           # [num_seqs + 1] int64
    draft_probs: torch.Tensor | SparseProbs | None   # q: [num_draft_tokens, vocab] dense, sparse, or None: all one-hot
    proposals: list[list[int]]           # the same ids on the host, per sequence (no readback needed)
    parents: list[list[int]] | None = None   # token trees (core/tree.py): per sequence its tokens' parents,
                                             # listed best-first (drafting/trees.py); None: single paths
    plans: list[DraftTree] | None = None     # tree drafters: per sequence the draw-free tree whose estimates
                                             # size its tree (DraftTree.plan: its own, or a sampled tree's
                                             # one-hot twin); kept where every tree came out a single path

    @classmethod
    def from_lists(cls, proposals: list[list[int]], device, probs=None, parents: list[list[int]] | None = None,
                   plans: list[DraftTree] | None = None) -> "DraftBatch":
        num = [len(p) for p in proposals]
        flat = [t for p in proposals for t in p]
        cu = torch.tensor([0] + list(np.cumsum(num)), dtype=torch.long, device=device)
        if parents is not None and all(is_chain(p) for p in parents):
            parents = None
        return cls(num, torch.tensor(flat, dtype=torch.long, device=device), cu, probs,
                   [list(p) for p in proposals], parents, plans)

    def to(self, device) -> "DraftBatch":
        move = lambda t: None if t is None else t.to(device)
        return DraftBatch(self.num_draft, move(self.draft_ids), move(self.cu_num_draft), move(self.draft_probs),
                          self.proposals, self.parents, self.plans)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def parents_of(self, b: int) -> list[int]:
        """Sequence b's parents (a single path's where the batch holds no tree)."""
        return self.parents[b] if self.parents is not None else chain(self.num_draft[b])

    def truncated(self, keep: list[int]) -> "DraftBatch":
        """Each tree's first keep[b] tokens: the best subtree of that size, as drafting/trees.py lists
        them (sampled trees: siblings still in the order they were drawn, each with its q row: the tree
        grown to keep[b] tokens; a tree smaller than keep[b] whole), and likewise its plan's."""
        plans = None if self.plans is None else [DraftTree(t.tokens[:k], t.parents[:k], t.probs[:k])
                                                 for t, k in zip(self.plans, keep)]
        out = DraftBatch.from_lists([p[:k] for p, k in zip(self.proposals, keep)], self.draft_ids.device, None,
                                    None if self.parents is None else [p[:k] for p, k in zip(self.parents, keep)],
                                    plans)
        first = [list(range(n)) for n in out.num_draft]
        return self._moved_q(out, first, first)

    def tokens(self, b: int) -> list[int]:
        return self.proposals[b]

    def spliced(self, ahead: list[list[int]], keep: list[int], trailing: list[list[int]]) -> "DraftBatch":
        """Sequence b's proposal becomes ahead[b] + its first keep[b] tokens + trailing[b]; the
        added tokens are one-hot rows of q (None stays None: every row one-hot). Single paths only."""
        if self.parents is not None:
            raise ValueError("a token tree cannot be spliced: graft it under the forced tokens")
        proposals = [a + p[:k] + t for a, p, k, t in zip(ahead, self.proposals, keep, trailing)]
        out = DraftBatch.from_lists(proposals, self.draft_ids.device)
        return self._moved_q(out, [list(range(len(a), len(a) + k)) for a, k in zip(ahead, keep)],
                             [list(range(k)) for k in keep])

    def grafted(self, ahead: list[list[int]], kept: list[list[int]]) -> "DraftBatch":
        """Sequence b's proposal becomes the chain ahead[b] and then its tree's tokens kept[b]
        (indices in order, every kept token's parent kept), whose root children hang under the last
        of ahead[b]; the added tokens are one-hot rows of q."""
        proposals, parents = [], []
        for b, (a, keep) in enumerate(zip(ahead, kept)):
            tree = self.parents_of(b)
            where = {old: len(a) + i for i, old in enumerate(keep)}
            proposals.append(a + [self.proposals[b][i] for i in keep])
            parents.append(list(range(-1, len(a) - 1)) + [where[tree[i]] if tree[i] >= 0 else len(a) - 1
                                                          for i in keep])
        out = DraftBatch.from_lists(proposals, self.draft_ids.device, None, parents)
        return self._moved_q(out, [[len(a) + i for i in range(len(keep))] for a, keep in zip(ahead, kept)], kept)

    def _moved_q(self, out: "DraftBatch", dst: list[list[int]], src: list[list[int]]) -> "DraftBatch":
        """`out` (a rearranged copy of this batch) with q: row src[b][i] of sequence b here becomes its
        row dst[b][i] there; every other row of `out` is one-hot at its token. None stays None."""
        if self.draft_probs is None:
            return out
        device = self.draft_ids.device
        old_cu, new_cu = [0, *np.cumsum(self.num_draft).tolist()], out.cu_num_draft.tolist()
        src_t = torch.tensor([old_cu[b] + i for b, rows in enumerate(src) for i in rows], dtype=torch.long,
                             device=device)
        dst_t = torch.tensor([new_cu[b] + i for b, rows in enumerate(dst) for i in rows], dtype=torch.long,
                             device=device)
        added = torch.ones(len(out.draft_ids), dtype=torch.bool, device=device)
        added[dst_t] = False
        added_t = added.nonzero().squeeze(1)
        if isinstance(self.draft_probs, SparseProbs):
            q = self.draft_probs
            where = torch.full((len(self.draft_ids),), -1, dtype=torch.long, device=device)
            where[src_t] = dst_t
            moved = where[q.row]
            hit = moved >= 0
            out.draft_probs = SparseProbs(torch.cat([moved[hit], added_t]),
                                          torch.cat([q.token[hit], out.draft_ids[added_t]]),
                                          torch.cat([q.prob[hit], torch.ones(len(added_t), dtype=q.prob.dtype,
                                                                             device=device)]))
            return out
        dense = torch.zeros(len(out.draft_ids), self.draft_probs.shape[-1], dtype=self.draft_probs.dtype,
                            device=device)
        dense[dst_t] = self.draft_probs[src_t]
        dense[added_t, out.draft_ids[added_t]] = 1.0
        out.draft_probs = dense
        return out

    def one_hot_rows(self) -> list[list[bool]]:
        """Per sequence, per proposal: whether its q is one-hot (the token was not drawn from a spread
        q), for every proposal at once in one tensor op."""
        q, total = self.draft_probs, len(self.draft_ids)
        if q is None:
            flags = [True] * total
        elif isinstance(q, SparseProbs):
            flags = (torch.bincount(q.row, minlength=total)[:total] == 1).tolist()
        else:
            flags = (q.amax(dim=-1) >= 1.0).tolist()
        cu = [0, *np.cumsum(self.num_draft).tolist()]
        return [flags[cu[b]:cu[b + 1]] for b in range(len(self.num_draft))]


@runtime_checkable
class Drafter(Protocol):
    """What the engine needs from a drafter. Per round the engine calls, in order: catch_up (lazy
    mode only), propose, then on_commit once the round's tokens are committed and the target's KV
    rolled back; release when a sequence finishes. prefill runs with the target's prompt prefill
    unless the engine is lazy (adaptive with a drafter that is not free)."""

    @property
    def is_free(self) -> bool:
        """Drafting costs no model forward (n-gram lookup, none): the adaptive policy prices it at 0."""

    @property
    def draft_runner(self) -> ModelRunner | None:
        """The draft model's runner (vocabulary check, calibration), or None without a model."""

    def prefill(self, chunks: list[Chunk]) -> None:
        """KV for the prompt chunks (seq, n) the target prefills this step (eager draft prefill)."""

    def reuse_prefix(self, seq: Sequence, reuse: Reuse) -> None:
        """`seq` (just admitted to seq.slot, nothing computed) starts with the target's KV of its
        prompt positions [0, reuse.num_tokens) copied from slot reuse.slot (seq.slot: left in place by
        the slot's last holder; num_tokens 0: nothing reused). Called once per admitted sequence,
        before any of its prefill, when the engine reuses prefixes; a drafter with its own KV may do
        the same."""

    def catch_up_lag(self, seq: Sequence) -> int:
        """Draft KV positions to prefill before `seq` can draft (0: none needed); the adaptive
        policy weighs it against what drafting would save."""

    def catch_up(self, seqs: list[Sequence], lengths: list[int], budget: int) -> tuple[list[int], int]:
        """Lazy prefill for sequences about to draft (lengths[b] > 0), at most `budget` positions in
        all. Returns the lengths (0 where a sequence is still behind) and the positions prefilled."""

    def propose(self, seqs: list[Sequence], lengths: list[int],
                generators: list[torch.Generator], guide: GuideView | None = None) -> DraftBatch:
        """Up to lengths[b] draft tokens for seqs[b]; any random draw comes from generators[b]. A
        drafter configured for token trees (suffix, n-gram) may return a tree per sequence instead
        (DraftBatch.parents), of lengths[b] tokens at most.
        With a guide (rows constrained by a grammar): seqs[b]'s draft continues after the forced
        tokens guide.ahead(b); a drafter that draws from a spread q masks it with guide.allowed and
        reports each token with guide.advance. Token-only drafters need do neither: the engine cuts
        their drafts at the first token the grammar forbids (drafting/guided.py)."""

    def on_commit(self, seqs: list[Sequence]) -> None:
        """The round's tokens are committed: roll per-sequence state back to the committed history."""

    def release(self, seq: Sequence) -> None:
        """`seq` finished: forget its state."""



class FreeDrafter:
    """Base for drafters without a model or per-sequence state: the protocol's no-op members."""
    is_free = True
    draft_runner = None

    def prefill(self, chunks: list[Chunk]) -> None:
        pass

    def reuse_prefix(self, seq: Sequence, reuse: Reuse) -> None:
        pass

    def catch_up_lag(self, seq: Sequence) -> int:
        return 0

    def catch_up(self, seqs: list[Sequence], lengths: list[int], budget: int) -> tuple[list[int], int]:
        return list(lengths), 0

    def on_commit(self, seqs: list[Sequence]) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass



class NoDrafter(FreeDrafter):
    kind = "none"

    def __init__(self, device="cpu"):
        self.device = device

    def propose(self, seqs: list[Sequence], lengths: list[int],
                generators: list[torch.Generator], guide: GuideView | None = None) -> DraftBatch:
        return DraftBatch.from_lists([[] for _ in seqs], self.device)

