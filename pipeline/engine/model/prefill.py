"""Chunked history prefill: KV (no logits) for a stretch of each sequence's committed history.

Used for the target's prompt (the engine) and for the draft model's prompt or lazy catch-up (the
draft-model drafter). Where the runner's attention pads rows to the longest, rows are grouped so
that padded batches waste little; where each row attends over its own keys (our CPU kernel, flex
on every step), all chunks go in one forward. The caller owns the computed lengths: this module
forwards tokens and moves no length.
"""
from __future__ import annotations

from typing import Callable

from ..core.request import Sequence
from .runner import ModelRunner

Chunk = tuple[Sequence, int]          # (sequence, number of history tokens to prefill)


def padding_groups(chunks: list[Chunk], slack: float = 1.25) -> list[list[Chunk]]:
    """Split prefill chunks into padded batches that waste little: sorted by length, a group grows
    while its padded size stays within `slack` x its real tokens (+ a small constant)."""
    groups: list[list[Chunk]] = []
    for chunk in sorted(chunks, key=lambda c: -c[1]):
        group = groups[-1] if groups else None
        if group and group[0][1] * (len(group) + 1) <= slack * (sum(n for _, n in group) + chunk[1]) + 16:
            group.append(chunk)
        else:
            groups.append([chunk])
    return groups


def forward_history(runner: ModelRunner, chunks: list[Chunk], computed: Callable[[Sequence], int]) -> None:
    """KV (no logits) for chunks (seq, n): the n tokens of each sequence's history after its first
    `computed(seq)` positions in `runner`'s store, in one forward or in low-padding groups."""
    groups = padding_groups(chunks) if runner.pads_rows else [chunks] if chunks else []
    for group in groups:
        starts = [computed(seq) for seq, _ in group]
        tokens = [seq.all_ids()[start:start + n] for (seq, n), start in zip(group, starts)]
        runner.forward([seq.slot for seq, _ in group], starts, tokens, logits="none")
