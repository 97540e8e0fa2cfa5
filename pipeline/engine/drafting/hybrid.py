"""HybridDrafter: a free lookup's proposal (n-gram, or the suffix index) where it finds one, the draft
model's elsewhere, in one DraftBatch (one-hot rows and the model's q side by side).

It knows nothing about verification, stops or cost models.
"""
from __future__ import annotations

import torch

from ..core.prefix import Reuse
from ..core.request import Sequence
from ..core.verify import SparseProbs
from ..grammar.walk import GuideView
from ..model.prefill import Chunk
from ..model.runner import ModelRunner
from .base import DraftBatch, Drafter
from .draft_model import DraftModelDrafter


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
                generators: list[torch.Generator], guide: GuideView | None = None) -> DraftBatch:
        found = self.first.propose(seqs, lengths, generators, guide)
        proposals = [found.tokens(b) for b in range(len(seqs))]
        need = [b for b, (p, g) in enumerate(zip(proposals, lengths)) if g > 0 and not p]
        sub = self.model.propose([seqs[b] for b in need], [lengths[b] for b in need],
                                 [generators[b] for b in need], guide.subset(need) if guide else None)
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

