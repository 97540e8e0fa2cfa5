"""Each sequence's randomness, explicit: two CPU generators seeded from (job seed, request id) alone,
one for its drafts and one for its verification, and the uniforms a round's verification draws
from the latter. No global RNG: the same seed and prompt sample the same tokens whatever the batch
or admission order.

Knows a sequence's sampling parameters; nothing of models, drafts' content or the verifier's rule.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .request import Sequence


@dataclass
class SeqRng:
    draft: torch.Generator
    verify: torch.Generator


def seq_generators(seed: int, request_id: str) -> SeqRng:
    """Independent CPU generators for a sequence, from (seed, request id) only: the same seed and
    prompt sample the same tokens whatever the batch or admission order."""
    def gen(salt: str) -> torch.Generator:
        digest = hashlib.sha256(f"{seed}\x00{request_id}\x00{salt}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return SeqRng(draft=gen("draft"), verify=gen("verify"))


def verify_uniforms(batch: list[Sequence], num_draft: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """g + 1 uniforms per sampled sequence per round, from its own verify generator (host tensors):
    ([sum(g)] for accepting the drafts, [num_seqs] for the recovered or bonus token); zeros for a
    greedy row, whose generator is not touched."""
    accept, sample = [], []
    for s, g in zip(batch, num_draft):
        u = torch.zeros(g + 1) if s.params.is_greedy else torch.rand(g + 1, generator=s.rng.verify)
        accept.append(u[:g])
        sample.append(u[g:])
    return torch.cat(accept), torch.cat(sample)
