"""Drafters: propose up to g tokens per sequence. Proposers never verify.

- DraftModelDrafter: a small model sharing the target's tokenizer, with its own slot KV store that
  follows the committed history (rollback = a length). `sample_method` "greedy" proposes the draft's
  argmax (token only, one-hot q); "probabilistic" samples from q and keeps it for verification.
- NgramDrafter: prompt lookup over prompt + generated tokens (token only).
- HybridDrafter: the n-gram proposal where one exists, the draft model elsewhere.
- NoDrafter: draft length 0, i.e. plain autoregressive decoding through the same engine.

Every proposal is returned flat (DraftBatch): token ids of all sequences concatenated, with offsets.
This module knows nothing about verification or stops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .logits import RowParams, greedy_tokens, processed_probs, token_counts
from .request import Sequence
from .runner import ModelRunner
from .verify import sample_from_probs


@dataclass
class DraftBatch:
    num_draft: list[int]                 # [num_seqs] proposed tokens per sequence (may be 0)
    draft_ids: torch.Tensor              # [num_draft_tokens] int64, flat
    cu_num_draft: torch.Tensor           # [num_seqs + 1] int64
    draft_probs: torch.Tensor | None     # [num_draft_tokens, vocab] q, or None: all one-hot
    is_onehot: torch.Tensor | None       # [num_draft_tokens] bool, for mixed batches (hybrid)

    @classmethod
    def from_lists(cls, proposals: list[list[int]], device, probs=None, is_onehot=None) -> "DraftBatch":
        num = [len(p) for p in proposals]
        flat = [t for p in proposals for t in p]
        cu = torch.tensor([0] + list(np.cumsum(num)), dtype=torch.long, device=device)
        return cls(num, torch.tensor(flat, dtype=torch.long, device=device), cu, probs, is_onehot)

    def to(self, device) -> "DraftBatch":
        move = lambda t: None if t is None else t.to(device)
        return DraftBatch(self.num_draft, move(self.draft_ids), move(self.cu_num_draft), move(self.draft_probs),
                          move(self.is_onehot))

    def tokens(self, b: int) -> list[int]:
        return self.draft_ids[int(self.cu_num_draft[b]):int(self.cu_num_draft[b + 1])].tolist()


def penalty_counts(seqs: list[Sequence], extra: list[list[int]], vocab: int, device):
    """Output and prompt token counts for rows whose history is seq.output_ids + extra[r]."""
    outputs = [s.output_ids + e for s, e in zip(seqs, extra)]
    return token_counts(outputs, vocab, device), token_counts([s.prompt_ids for s in seqs], vocab, device)


def row_probs(logits: torch.Tensor, seqs: list[Sequence], extra: list[list[int]],
              argmax_only: bool = False) -> torch.Tensor:
    """Processed distributions for rows (seqs[r] with candidate suffix extra[r]): [rows, vocab];
    with argmax_only, just their greedy choice: [rows]."""
    rp = RowParams.from_params([s.params for s in seqs], logits.device)
    counts = penalty_counts(seqs, extra, logits.shape[-1], logits.device) if rp.has_penalties else (None, None)
    return (greedy_tokens if argmax_only else processed_probs)(logits, rp, *counts)


class NoDrafter:
    kind = "none"
    runner = None

    def __init__(self, device="cpu"):
        self.device = device

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> DraftBatch:
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


class NgramDrafter:
    kind = "ngram"
    runner = None

    def __init__(self, min_n: int = 2, max_n: int = 4, device="cpu"):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: expected 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.device = min_n, max_n, device

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0:
            return []
        return ngram_lookup(np.asarray(seq.all_ids(), dtype=np.int64), self.min_n, self.max_n, k)

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> DraftBatch:
        return DraftBatch.from_lists([self.lookup(s, g) for s, g in zip(seqs, num_draft)], self.device)


class DraftModelDrafter:
    kind = "draft"

    def __init__(self, runner: ModelRunner, sample_method: str = "greedy",
                 uniform: Callable[[Sequence], float] | None = None):
        if sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"draft_sample_method: expected 'greedy' or 'probabilistic', got {sample_method!r}")
        self.runner, self.sample_method = runner, sample_method
        self.uniform = uniform      # per-sequence uniform draw, set by the engine (the seq's draft generator)

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> DraftBatch:
        # Token only (one-hot q, never stored) for the greedy method or an all-greedy batch.
        token_only = self.sample_method == "greedy" or all(s.params.is_greedy for s in seqs)
        proposals: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(num_draft, default=0)):
            active = [b for b, g in enumerate(num_draft) if g > step]
            self._draft_step([seqs[b] for b in active], [proposals[b] for b in active],
                             [probs[b] for b in active], token_only)
        flat_probs = None if token_only or not any(probs) else torch.cat([torch.stack(p) for p in probs if p])
        return DraftBatch.from_lists(proposals, self.runner.device, flat_probs, None)

    def _draft_step(self, seqs: list[Sequence], proposals: list[list[int]], probs: list[list],
                    token_only: bool) -> None:
        """One draft forward for these sequences: catch up on committed tokens the draft has no KV for
        (first step of a round) or feed the previous draft token; propose the next one."""
        slots, starts, inputs = [], [], []
        for seq, prop in zip(seqs, proposals):
            history = seq.all_ids() + prop[:-1]            # tokens the draft must have KV for
            slots.append(seq.slot)
            starts.append(seq.num_draft_computed)
            inputs.append(history[seq.num_draft_computed:] + prop[-1:])
            seq.num_draft_computed = len(history) + (1 if prop else 0)
        logits = self.runner.forward(slots, starts, inputs, logits="last")   # [rows, vocab]
        if token_only:
            tokens = row_probs(logits, seqs, proposals, argmax_only=True)
        else:
            q = row_probs(logits, seqs, proposals)                           # [rows, vocab]
            tokens = sample_from_probs(q, torch.tensor([self.uniform(s) for s in seqs], device=q.device))
            for b in range(len(seqs)):
                probs[b].append(q[b])
        for b, tok in enumerate(tokens.tolist()):
            proposals[b].append(tok)


class HybridDrafter:
    """n-gram proposal where one exists, the draft model elsewhere."""
    kind = "hybrid"

    def __init__(self, ngram: NgramDrafter, model: DraftModelDrafter):
        self.ngram, self.model, self.runner = ngram, model, model.runner

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> DraftBatch:
        ngram_props = [self.ngram.lookup(s, g) for s, g in zip(seqs, num_draft)]
        need = [b for b, (p, g) in enumerate(zip(ngram_props, num_draft)) if g > 0 and not p]
        sub = self.model.propose([seqs[b] for b in need], [num_draft[b] for b in need])
        proposals = list(ngram_props)
        for i, b in enumerate(need):
            proposals[b] = sub.tokens(i)
        device = self.runner.device
        if sub.draft_probs is None:
            return DraftBatch.from_lists(proposals, device)
        return self._mixed(proposals, need, sub, device)

    @staticmethod
    def _mixed(proposals, need, sub: DraftBatch, device) -> DraftBatch:
        """Scatter the model's q rows into the flat batch; n-gram rows are marked one-hot."""
        batch = DraftBatch.from_lists(proposals, device)
        vocab = sub.draft_probs.shape[-1]
        probs = torch.zeros(len(batch.draft_ids), vocab, dtype=sub.draft_probs.dtype, device=device)
        is_onehot = torch.ones(len(batch.draft_ids), dtype=torch.bool, device=device)
        for i, b in enumerate(need):
            lo, hi = int(batch.cu_num_draft[b]), int(batch.cu_num_draft[b + 1])
            probs[lo:hi] = sub.draft_probs[int(sub.cu_num_draft[i]):int(sub.cu_num_draft[i + 1])]
            is_onehot[lo:hi] = False
        batch.draft_probs, batch.is_onehot = probs, is_onehot
        return batch
