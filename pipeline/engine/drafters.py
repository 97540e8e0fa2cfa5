"""Drafters: propose up to g tokens per sequence. Proposers never verify.

The engine talks to a drafter only through the `Drafter` protocol below; it never reads or writes a
drafter's attributes. Implementations:

- DraftModelDrafter: a small model sharing the target's tokenizer, with its own slot KV store that
  follows the committed history (rollback = a length). It owns its per-sequence KV lengths and
  their catch-up. `sample_method` "greedy" proposes the draft's argmax (token only, one-hot q);
  "probabilistic" samples from q with the sequence's draft generator and keeps q for verification.
- NgramDrafter: prompt lookup over prompt + generated tokens (token only, free).
- HybridDrafter: a free token-only drafter's proposal (n-gram, or suffix.py's SuffixDrafter) where
  one exists, the draft model elsewhere.
- NoDrafter: draft length 0, i.e. plain autoregressive decoding through the same engine.

Every proposal is returned flat (DraftBatch): token ids of all sequences concatenated, with offsets.
This module knows nothing about verification, stops or cost models.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .logits import row_probs
from .prefill import Chunk, forward_history
from .prefix import Reuse
from .request import Sequence
from .runner import ModelRunner
from .verify import SparseProbs, sample_from_probs


@dataclass
class DraftBatch:
    num_draft: list[int]                 # [num_seqs] proposed tokens per sequence (may be 0)
    draft_ids: torch.Tensor              # [num_draft_tokens] int64, flat
    cu_num_draft: torch.Tensor           # [num_seqs + 1] int64
    draft_probs: torch.Tensor | SparseProbs | None   # q: [num_draft_tokens, vocab] dense, sparse, or None: all one-hot
    proposals: list[list[int]]           # the same ids on the host, per sequence (no readback needed)

    @classmethod
    def from_lists(cls, proposals: list[list[int]], device, probs=None) -> "DraftBatch":
        num = [len(p) for p in proposals]
        flat = [t for p in proposals for t in p]
        cu = torch.tensor([0] + list(np.cumsum(num)), dtype=torch.long, device=device)
        return cls(num, torch.tensor(flat, dtype=torch.long, device=device), cu, probs,
                   [list(p) for p in proposals])

    def to(self, device) -> "DraftBatch":
        move = lambda t: None if t is None else t.to(device)
        return DraftBatch(self.num_draft, move(self.draft_ids), move(self.cu_num_draft), move(self.draft_probs),
                          self.proposals)

    def tokens(self, b: int) -> list[int]:
        return self.proposals[b]


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
                generators: list[torch.Generator]) -> DraftBatch:
        """Up to lengths[b] draft tokens for seqs[b]; any random draw comes from generators[b]."""

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
                generators: list[torch.Generator]) -> DraftBatch:
        return DraftBatch.from_lists([[] for _ in seqs], self.device)


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram
    (max_n down to min_n) of `tokens`. Empty when nothing matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)   # starts 0..length-1-n
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramDrafter(FreeDrafter):
    kind = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4, device="cpu"):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: expected 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.device = min_n, max_n, device

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0:
            return []
        return ngram_lookup(np.asarray(seq.all_ids(), dtype=np.int64), self.min_n, self.max_n, k)

    def propose(self, seqs: list[Sequence], lengths: list[int],
                generators: list[torch.Generator]) -> DraftBatch:
        return DraftBatch.from_lists([self.lookup(s, g) for s, g in zip(seqs, lengths)], self.device)


def draft_lag(num_tokens: int, num_computed: int) -> int:
    """Draft-model positions to prefill before a sequence of `num_tokens` committed tokens, with
    `num_computed` draft KV positions, can draft: its history (all but the last token, the next
    round's input) beyond the draft KV, or 0 when that lag is the 1-2 positions a drafting round
    leaves behind anyway."""
    lag = num_tokens - 1 - num_computed
    return lag if lag > 2 else 0


def _uniforms(generators: list[torch.Generator], device) -> torch.Tensor:
    """[rows] one uniform per row, each from its sequence's own draft generator."""
    return torch.tensor([float(torch.rand(1, generator=g)) for g in generators], device=device)


class DraftModelDrafter:
    """A draft model over its own slot KV store (the sequence's slot). Owns each running sequence's
    draft KV length: it follows the committed history, lags it after a round by at most 2 (a bonus
    token), and is rolled back on commit (a length move).

    Prefix reuse: where the target copies a prompt prefix from a donor slot, the draft copies the
    part of it its own store holds for the donor's prompt (its holder's draft KV, or what the last
    holder left when it finished), so a shared system prompt is computed once by the draft too."""
    kind = "draft"
    is_free = False

    def __init__(self, runner: ModelRunner, sample_method: str = "greedy"):
        if sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"draft_sample_method: expected 'greedy' or 'probabilistic', got {sample_method!r}")
        self.runner, self.sample_method = runner, sample_method
        self._computed: dict[Sequence, int] = {}      # draft positions with KV, per sequence holding a slot
        self._left: dict[int, int] = {}               # slot -> prompt positions of draft KV its last holder left

    @property
    def draft_runner(self) -> ModelRunner:
        return self.runner

    def num_computed(self, seq: Sequence) -> int:
        """Draft-model positions of `seq` with KV."""
        return self._computed.get(seq, 0)

    def prefill(self, chunks: list[Chunk]) -> None:
        forward_history(self.runner, chunks, self.num_computed)
        for seq, n in chunks:
            self._computed[seq] = self.num_computed(seq) + n

    def catch_up_lag(self, seq: Sequence) -> int:
        return draft_lag(seq.num_tokens, self.num_computed(seq))

    def catch_up(self, seqs: list[Sequence], lengths: list[int], budget: int) -> tuple[list[int], int]:
        """Bring the draft KV up to the committed history for sequences about to draft whose draft KV
        lags by more than a round's usual 1-2 tokens (a new prompt, or a stretch at g = 0), within
        `budget` positions; a sequence still behind drafts nothing this round."""
        lengths, chunks = list(lengths), []
        for b, (seq, g) in enumerate(zip(seqs, lengths)):
            lag = self.catch_up_lag(seq)
            if g == 0 or not lag:
                continue
            take = min(lag, budget)
            if take:
                chunks.append((seq, take))
                budget -= take
            if take < lag:
                lengths[b] = 0
        self.prefill(chunks)
        self.runner.synchronize()
        return lengths, sum(n for _, n in chunks)

    def on_commit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:                   # rollback = a length: KV for committed tokens only
            if seq in self._computed:
                self._computed[seq] = min(self._computed[seq], seq.num_tokens - 1)

    def release(self, seq: Sequence) -> None:
        self._left[seq.slot] = self._prompt_held(seq)
        self._computed.pop(seq, None)

    def _prompt_held(self, seq: Sequence) -> int:
        return min(self.num_computed(seq), len(seq.prompt_ids))

    def reuse_prefix(self, seq: Sequence, reuse: Reuse) -> None:
        """Copy draft KV [0, m) from the donor slot, m = the target's count capped by the prompt
        positions the draft store holds there for the same prompt: the live holder's, or what the
        slot's last holder left (the target's index matches a slot against its current holder, or
        against a finished one's frozen prompt)."""
        m = 0
        if reuse.num_tokens:
            held = (self._prompt_held(reuse.holder) if reuse.holder is not None
                    else self._left.get(reuse.slot, 0))
            m = min(reuse.num_tokens, held)
            if m and reuse.slot != seq.slot:
                self.runner.copy_prefix(reuse.slot, seq.slot, m)
        self._left.pop(seq.slot, None)
        if m:
            self._computed[seq] = m

    def propose(self, seqs: list[Sequence], lengths: list[int],
                generators: list[torch.Generator]) -> DraftBatch:
        # Token only (one-hot q, never stored) for the greedy method or an all-greedy batch.
        token_only = self.sample_method == "greedy" or all(s.params.is_greedy for s in seqs)
        proposals: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(lengths, default=0)):
            active = [b for b, g in enumerate(lengths) if g > step]
            self._draft_step([seqs[b] for b in active], [proposals[b] for b in active],
                             [probs[b] for b in active], [generators[b] for b in active], token_only)
        flat_probs = None if token_only or not any(probs) else torch.cat([torch.stack(p) for p in probs if p])
        return DraftBatch.from_lists(proposals, self.runner.device, flat_probs)

    def _draft_step(self, seqs: list[Sequence], proposals: list[list[int]], probs: list[list],
                    generators: list[torch.Generator], token_only: bool) -> None:
        """One draft forward for these sequences: catch up on committed tokens the draft has no KV for
        (first step of a round) or feed the previous draft token; propose the next one."""
        starts, inputs = [self.num_computed(seq) for seq in seqs], []
        for seq, prop, start in zip(seqs, proposals, starts):
            history = seq.all_ids() + prop[:-1]            # tokens the draft must have KV for
            inputs.append(history[start:] + prop[-1:])
            self._computed[seq] = len(history) + (1 if prop else 0)
        logits = self.runner.forward([seq.slot for seq in seqs], starts, inputs, logits="last")   # [rows, vocab]
        if token_only:
            tokens = row_probs(logits, seqs, proposals, argmax_only=True)
        else:
            q = row_probs(logits, seqs, proposals)                           # [rows, vocab]
            tokens = sample_from_probs(q, _uniforms(generators, q.device))
            for b in range(len(seqs)):
                probs[b].append(q[b])
        for b, tok in enumerate(tokens.tolist()):
            proposals[b].append(tok)


class HybridDrafter:
    """A free token-only drafter's proposal (n-gram or suffix) where one exists, the draft model
    elsewhere. Both parts are used through the Drafter protocol and see every prefill, commit and
    release; the draft KV is the model part's."""
    kind = "hybrid"
    is_free = False

    def __init__(self, first: Drafter, model: DraftModelDrafter):
        if not first.is_free:
            raise ValueError(f"hybrid: the first part must be a free token-only drafter, got {type(first).__name__}")
        self.first, self.model = first, model

    @property
    def draft_runner(self) -> ModelRunner:
        return self.model.draft_runner

    def num_computed(self, seq: Sequence) -> int:
        return self.model.num_computed(seq)

    def prefill(self, chunks: list[Chunk]) -> None:
        self.first.prefill(chunks)
        self.model.prefill(chunks)

    def reuse_prefix(self, seq: Sequence, reuse: Reuse) -> None:
        self.first.reuse_prefix(seq, reuse)
        self.model.reuse_prefix(seq, reuse)

    def catch_up_lag(self, seq: Sequence) -> int:
        return self.model.catch_up_lag(seq)

    def catch_up(self, seqs: list[Sequence], lengths: list[int], budget: int) -> tuple[list[int], int]:
        return self.model.catch_up(seqs, lengths, budget)

    def on_commit(self, seqs: list[Sequence]) -> None:
        self.first.on_commit(seqs)
        self.model.on_commit(seqs)

    def release(self, seq: Sequence) -> None:
        self.first.release(seq)
        self.model.release(seq)

    def propose(self, seqs: list[Sequence], lengths: list[int],
                generators: list[torch.Generator]) -> DraftBatch:
        found = self.first.propose(seqs, lengths, generators)
        proposals = [found.tokens(b) for b in range(len(seqs))]
        need = [b for b, (p, g) in enumerate(zip(proposals, lengths)) if g > 0 and not p]
        sub = self.model.propose([seqs[b] for b in need], [lengths[b] for b in need],
                                 [generators[b] for b in need])
        for i, b in enumerate(need):
            proposals[b] = sub.tokens(i)
        device = self.draft_runner.device
        if sub.draft_probs is None and found.draft_probs is None:
            return DraftBatch.from_lists(proposals, device)
        return self._mixed(proposals, need, found, sub, device)

    @staticmethod
    def _mixed(proposals, need, found: DraftBatch, sub: DraftBatch, device) -> DraftBatch:
        """Both parts' q in one flat batch: the first part's rows (sparse q, or one-hot), then the
        model's (dense q, or one-hot), each part's rows in its own order. Dense where the model
        kept q (the first part's entries scattered in), sparse otherwise."""
        batch = DraftBatch.from_lists(proposals, device)
        cu, needed = batch.cu_num_draft.tolist(), set(need)
        rows = lambda seqs: torch.tensor([r for b in seqs for r in range(cu[b], cu[b + 1])], dtype=torch.long,
                                         device=device)
        first_rows, model_rows = rows(b for b in range(len(proposals)) if b not in needed), rows(need)
        fq = found.draft_probs.to(device) if found.draft_probs is not None else SparseProbs(
            torch.arange(len(first_rows), device=device), batch.draft_ids[first_rows],
            torch.ones(len(first_rows), device=device))
        if sub.draft_probs is None:                     # the model's rows one-hot: stay sparse
            batch.draft_probs = SparseProbs(torch.cat([first_rows[fq.row], model_rows]),
                                            torch.cat([fq.token, batch.draft_ids[model_rows]]),
                                            torch.cat([fq.prob, torch.ones(len(model_rows), device=device)]))
            return batch
        probs = torch.zeros(len(batch.draft_ids), sub.draft_probs.shape[-1], dtype=sub.draft_probs.dtype,
                            device=device)
        probs[model_rows] = sub.draft_probs.to(device)
        probs[first_rows[fq.row], fq.token] = fq.prob.to(probs.dtype)
        batch.draft_probs = probs
        return batch
