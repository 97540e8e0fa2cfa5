"""The round's admit stage: requests checked and queued, then admitted into free slots and prefilled.

`Intake` turns add_request's arguments into a Sequence ready to queue: every field checked (a
RequestError names the bad one), the row's response_format compiled, its generators seeded from
(seed, request id) alone (core/rng.py); it remembers the ids in flight. `admit_and_prefill` gives
waiting sequences the free slots, lets each copy the longest prompt prefix a slot holds where
prefix reuse is on (core/prefix.py), and prefills this step's chunks of every prompt but its last
token (the first round's input).

Knows the scheduler, the prefix index and the runners' prefill; nothing of draft lengths,
verification or commit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .core.prefix import PrefixIndex
from .core.request import RequestError, SamplingParams, Sequence
from .core.rng import seq_generators
from .core.scheduler import Scheduler
from .model.prefill import forward_history

if TYPE_CHECKING:
    from .drafting.base import Drafter
    from .grammar.library import Grammars
    from .model.runner import ModelRunner


class Intake:
    """The checks a request passes before it is queued, and the request ids in flight."""

    def __init__(self, max_model_len: int, vocab_size: int, grammars: Grammars | None):
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.grammars = grammars             # compiles response_format (None: requests may not have one)
        self.ids: set[str] = set()

    def sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams | None,
                 seed: int) -> Sequence:
        """The request's sequence, its id now in flight. Raises RequestError (naming the field) for bad input."""
        params = params or SamplingParams()
        self._validate(request_id, prompt_ids, params)
        seq = Sequence(str(request_id), [int(t) for t in prompt_ids], params, int(seed))
        fmt = params.constraint
        if fmt is not None:
            if self.grammars is None:
                raise RequestError("response_format", "this engine has no grammar support (no tokenizer "
                                                      "given); expected no response_format", "bad_response_format")
            seq.guide = self.grammars.guide(fmt)       # RequestError when it does not compile
        seq.rng = seq_generators(seq.seed, seq.request_id)
        self.ids.add(seq.request_id)
        return seq

    def forget(self, request_id: str) -> None:
        """A finished request's id may be used again."""
        self.ids.discard(request_id)

    def _validate(self, request_id, prompt_ids, params) -> None:
        if not isinstance(params, SamplingParams):
            raise RequestError("params", f"expected SamplingParams, got {type(params).__name__}", "bad_sampling")
        if str(request_id) in self.ids:
            raise RequestError("request_id", f"duplicate id {request_id!r}", "duplicate_id")
        if len(prompt_ids) == 0:
            raise RequestError("prompt", "empty prompt: expected at least 1 token", "empty_prompt")
        limit = self.max_model_len - 1
        if len(prompt_ids) > limit:
            raise RequestError("prompt", f"{len(prompt_ids)} tokens; expected at most {limit} "
                                         f"(max_model_len {self.max_model_len} leaves room for 1 new token)",
                               "prompt_too_long")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise RequestError("prompt", f"token id {bad[0]} outside [0, {self.vocab_size})", "bad_token_id")


def admit_and_prefill(scheduler: Scheduler, prefixes: PrefixIndex | None, target: ModelRunner, drafter: Drafter,
                      prefill_drafter: bool) -> None:
    """Admit into free slots, then prefill this step's chunks (all prompt tokens but the last,
    which is the first round's input) for the target and (prefill_drafter: unless the drafter
    catches up lazily) the drafter."""
    admitted = scheduler.admit()
    if prefixes is not None:
        reuse_prefixes(scheduler, prefixes, target, drafter, admitted)
    chunks = scheduler.prefill_chunks(
        lambda s: 0 if prefixes is not None and not prefixes.is_planned(s)
        else len(s.prompt_ids) - 1 - s.num_computed)
    forward_history(target, chunks, lambda seq: seq.num_computed)
    if prefill_drafter:
        drafter.prefill(chunks)
    for seq, n in chunks:
        seq.num_computed += n
    for seq in list(scheduler.prefilling):
        if seq.num_computed == len(seq.prompt_ids) - 1:
            scheduler.promote(seq)


def reuse_prefixes(scheduler: Scheduler, prefixes: PrefixIndex, target: ModelRunner, drafter: Drafter,
                   admitted: list[Sequence]) -> None:
    """New sequences copy the target KV of the longest prompt prefix a slot holds (core/prefix.py), in
    admission order; one whose prefix an earlier sequence is still computing waits a step."""
    for seq in admitted:
        prefixes.admit(seq)
    for seq in list(scheduler.prefilling):
        if prefixes.is_planned(seq):
            continue
        reuse = prefixes.plan(seq)
        if reuse is not None:
            if reuse.num_tokens and reuse.slot != seq.slot:
                target.copy_prefix(reuse.slot, seq.slot, reuse.num_tokens)
            seq.num_computed = seq.num_prefix_reused = reuse.num_tokens
            drafter.reuse_prefix(seq, reuse)
