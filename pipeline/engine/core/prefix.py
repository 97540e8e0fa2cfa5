"""Prompt-prefix reuse: which prompt prefixes the target's slot store already holds. No torch.

Offline jobs repeat themselves: thousands of prompts share a chat template's system prompt, a
synthetic-data template, or are the same prompt sampled several times. The KV of position i is a
function of tokens 0..i only (causal attention), so a new sequence whose prompt starts with tokens
some slot already holds KV for can copy those positions instead of computing them. Measured on the
bench's templated prompts (190 tokens on average), 116 of them are shared with an earlier prompt.

What a slot holds, per slot, in `PrefixIndex`:
  * a sequence that holds the slot: its prompt's first `num_computed` positions (after any round's
    commit, positions below num_computed are committed tokens; only the prompt part is indexed);
  * a slot freed by a finished sequence: that sequence's prompt prefix, as it was at release, until
    the slot is taken again (a free slot's store is not touched).
`plan(seq)`, before a new sequence's prefill starts, answers the slot holding the longest prefix of
its prompt and how many positions to copy: at most len(prompt) - 1, since the last prompt token is
the first round's input; reuse under `min_tokens` is not worth a copy. Prompts admitted together
(a batch job's first wave, two samples of one prompt) would all compute the shared part side by
side, so a sequence whose prefix an earlier-admitted sequence is still computing waits for it.

Exactness: the copied KV is what the target computed for the same tokens at the same positions, so
the round sees the same distribution. It is bitwise what a fresh prefill would compute wherever a
row's KV does not depend on which rows were batched with it (our CPU kernels: per-row linears and
attention). Elsewhere it can differ at the rounding level, as batching does.

Lookups compare token bytes (C-speed slice comparisons, a binary search per slot), linear in the
slots: measured 0.13 ms per admission at 32 slots of 300-token prompts, 0.7 ms at 256 slots, 2.9 ms
at 256 slots of 2,000-token prompts sharing 1,500 (bench/RESULTS.md, "Prefix reuse"), against the
milliseconds per token of prefill a reuse saves.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

from .request import Sequence


def _bytes(tokens: list[int]) -> bytes:
    return array("q", tokens).tobytes()


def common_prefix(a: bytes, b: bytes, limit: int) -> int:
    """Length in tokens (8 bytes each) of the longest common prefix of a and b, at most `limit`."""
    lo, hi = 0, min(limit, len(a) // 8, len(b) // 8)
    while lo < hi:                              # invariant: the first lo tokens agree
        mid = (lo + hi + 1) // 2
        if a[:mid * 8] == b[:mid * 8]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Reuse:
    """A plan's answer for one sequence: copy the target's KV of prompt positions [0, num_tokens) from
    `slot` (the sequence's own slot: in place, nothing to copy). `holder` is the live sequence holding
    that slot, or None where the slot's content is what its last holder left when it finished; a
    drafter with its own KV store reads from it how much of that prefix it holds too."""
    slot: int | None = None         # None with num_tokens 0: nothing worth reusing
    num_tokens: int = 0
    holder: Sequence | None = None


@dataclass
class _Held:
    prompt: bytes                   # the holder's prompt tokens
    seq: Sequence | None            # the sequence holding the slot; None once it finished
    order: int                      # admission order of the holder
    frozen_len: int = 0             # valid prompt positions of a freed slot
    before: "_Held | None" = None   # the freed holder this one replaced, until its prefill starts

    @property
    def valid(self) -> int:
        """Prompt positions of this slot whose KV is valid now."""
        if self.seq is None:
            return self.frozen_len
        return min(self.seq.num_computed, len(self.seq.prompt_ids))


class PrefixIndex:
    def __init__(self, min_tokens: int = 8):
        self.min_tokens = min_tokens
        self._slots: dict[int, _Held] = {}
        self._unplanned: set[Sequence] = set()       # admitted, prefill not started
        self._order = 0
        self.num_reused = 0             # prompt positions copied instead of computed, all time
        self.num_waits = 0              # steps a sequence's prefill waited for a donor's, all time

    def admit(self, seq: Sequence) -> None:
        """`seq` was just given seq.slot (num_computed 0): it holds the slot from now on."""
        self._order += 1
        before = self._slots.get(seq.slot)
        self._slots[seq.slot] = _Held(_bytes(seq.prompt_ids), seq, self._order,
                                      before=before if before is not None and before.seq is None else None)
        self._unplanned.add(seq)

    def is_planned(self, seq: Sequence) -> bool:
        return seq not in self._unplanned

    def plan(self, seq: Sequence) -> Reuse | None:
        """For an admitted sequence whose prefill has not started: what to reuse (Reuse(): nothing
        worth copying), or None: wait a step, because an earlier-admitted sequence still prefilling
        will soon hold at least `min_tokens` more of this prompt than any slot holds now.
        Earlier-admitted only, so waits never form a cycle; the caller sets num_computed to the
        reused count before the slot is written."""
        own = self._slots[seq.slot]
        limit = len(seq.prompt_ids) - 1
        # under min_tokens to copy: no slot can hold, nor soon hold, enough of it, and none is looked at
        candidates = self._candidates(seq.slot, own) if limit >= self.min_tokens else []
        best, best_n, soon = None, 0, 0          # best: (slot, _Held)
        for slot, held in candidates:
            shared = common_prefix(own.prompt, held.prompt, limit)
            n = min(shared, held.valid)
            if n > best_n:
                best, best_n = (slot, held), n
            if held.seq is not None and held.order < own.order:
                soon = max(soon, min(shared, len(held.seq.prompt_ids)))
        if soon >= best_n + self.min_tokens:
            self.num_waits += 1
            return None
        self._unplanned.remove(seq)
        own.before = None                  # the prefill overwrites the slot from here on
        if best_n < self.min_tokens:
            return Reuse()
        self.num_reused += best_n
        slot, held = best
        return Reuse(slot, best_n, held.seq)

    def _candidates(self, slot: int, own: _Held) -> list[tuple[int, _Held]]:
        """(slot, holder) of every other slot, after `own` slot's freed content (reused in place, no copy)."""
        others = [(other, held) for other, held in self._slots.items() if held is not own]
        return ([(slot, own.before)] if own.before is not None else []) + others

    def release(self, seq: Sequence) -> None:
        """A finished sequence leaves its slot: what it computed of its prompt stays reusable until the
        slot is taken again."""
        self._unplanned.discard(seq)
        held = self._slots.get(seq.slot)
        if held is not None and held.seq is seq:
            held.frozen_len, held.seq = held.valid, None
