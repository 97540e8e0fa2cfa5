"""Continuous batching: waiting queue, slots, admission, prefill budget, finishing. No torch.

A request is admitted the moment a slot frees; it takes the lowest free slot, so the running set
stays as contiguous as possible (the KV store reads contiguous slots as views). Its prompt KV is
computed in chunks of at most `max_prefill_tokens` per step, shared by all prefilling sequences,
so a long prompt never stalls the decoding batch for more than one chunk per step.

This module knows nothing about models, tokens' meaning or sampling.
"""
from __future__ import annotations

import heapq
from collections import deque

from .request import Sequence, Status


class Scheduler:
    def __init__(self, max_num_seqs: int, max_prefill_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_num_seqs))   # min-heap

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots; they start prefilling."""
        admitted = []
        while self.waiting and self._free_slots:
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self._free_slots)
            seq.status = Status.PREFILL
            self.prefilling.append(seq)
            admitted.append(seq)
        return admitted

    def prefill_chunks(self, num_to_prefill) -> list[tuple[Sequence, int]]:
        """(sequence, number of tokens) to prefill this step, within the token budget, oldest first.
        `num_to_prefill(seq)` says how many prompt tokens still need KV."""
        budget, chunks = self.max_prefill_tokens, []
        for seq in self.prefilling:
            need = num_to_prefill(seq)
            take = min(need, budget)
            if need and take:
                chunks.append((seq, take))
                budget -= take
            if budget <= 0:
                break
        return chunks

    def promote(self, seq: Sequence) -> None:
        """A sequence whose prompt KV is complete joins the decoding batch (kept in slot order)."""
        self.prefilling.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.running.sort(key=lambda s: s.slot)

    def release(self, seq: Sequence) -> None:
        """Free a finished sequence's slot at once."""
        for group in (self.running, self.prefilling):
            if seq in group:
                group.remove(seq)
        heapq.heappush(self._free_slots, seq.slot)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)
