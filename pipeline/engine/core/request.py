"""Per-sequence state and sampling parameters. No torch here: plain Python, tested as such.

A sequence's tokens are *committed* (in the output) or not; the target's KV store has *computed*
positions for some prefix of the committed tokens (the draft model's KV lengths are the draft-model
drafter's, not kept here). The target always has exactly one committed token without KV
(the last one: it is the next round's first input). Stops (EOS, stop token ids, stop strings,
max_tokens, the context limit) are applied here, token by token, so nothing past a stop is committed.

This module knows nothing about models, tensors or random generators; `rng` is an opaque slot the
engine fills, and text comes from a `decode` callable the engine passes in.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable
from typing import Sequence as Seq

from .response_format import FormatError, ResponseFormat, parse_response_format

FINISH_REASONS = ("stop", "eos", "length", "context")


class RequestError(ValueError):
    """A request that cannot run; `field` names the offending input, `code` classifies the reason
    (bad_sampling, empty_prompt, prompt_too_long, bad_token_id, duplicate_id, ...)."""

    def __init__(self, field: str, message: str, code: str = "bad_sampling"):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.code = code


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128               # new tokens at most, >= 1
    temperature: float = 0.0            # 0 = greedy; >= 0
    top_k: int = 0                      # keep the k most likely tokens; 0 = off
    top_p: float = 1.0                  # nucleus mass in (0, 1]
    min_p: float = 0.0                  # drop tokens below min_p * max prob; [0, 1]
    repetition_penalty: float = 1.0     # > 0; over prompt + output (1 = off)
    presence_penalty: float = 0.0       # over output tokens, [-2, 2]
    frequency_penalty: float = 0.0      # over output tokens, [-2, 2]
    stop: tuple[str, ...] = ()          # stop strings; the output text is cut before them
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the sequence
    ignore_eos: bool = False            # keep generating past EOS
    response_format: Any = None         # constrain the output (response_format.py): a dict or its JSON
                                        # text; kept as canonical JSON text

    def __post_init__(self):
        _check(self.max_tokens, "max_tokens", "an integer >= 1", lambda v: isinstance(v, int) and v >= 1)
        _check(self.temperature, "temperature", "a finite number >= 0", lambda v: _finite(v) and v >= 0)
        _check(self.top_k, "top_k", "an integer >= 0 (0 disables)", lambda v: isinstance(v, int) and v >= 0)
        _check(self.top_p, "top_p", "a number in (0, 1]", lambda v: _finite(v) and 0 < v <= 1)
        _check(self.min_p, "min_p", "a number in [0, 1]", lambda v: _finite(v) and 0 <= v <= 1)
        _check(self.repetition_penalty, "repetition_penalty", "a finite number > 0",
               lambda v: _finite(v) and v > 0)
        for name in ("presence_penalty", "frequency_penalty"):
            _check(getattr(self, name), name, "a number in [-2, 2]", lambda v: _finite(v) and -2 <= v <= 2)
        _check(self.stop, "stop", "a list of non-empty strings",
               lambda v: all(isinstance(s, str) and s for s in v))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        try:
            fmt = parse_response_format(self.response_format)
        except FormatError as e:
            raise RequestError("response_format", str(e), "bad_response_format") from None
        object.__setattr__(self, "response_format", None if fmt is None else fmt.to_json())
        if fmt is not None and self.ignore_eos:
            raise RequestError("ignore_eos", "cannot be combined with response_format: the grammar ends "
                                             "the output with EOS", "bad_sampling")

    @property
    def constraint(self) -> ResponseFormat | None:
        """The parsed response_format (None: free text)."""
        return parse_response_format(self.response_format)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check(value, name: str, expected: str, ok: Callable) -> None:
    try:
        good = ok(value)
    except TypeError:
        good = False
    if not good:
        raise RequestError(name, f"expected {expected}, got {value!r}")


class Status(enum.Enum):
    WAITING = "waiting"      # queued, no slot
    PREFILL = "prefill"      # has a slot, prompt KV being computed
    RUNNING = "running"      # decoding rounds
    FINISHED = "finished"


@dataclass(eq=False)          # identity: the scheduler removes sequences from lists
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int = -1
    num_computed: int = 0            # target positions with KV
    finish_reason: str | None = None
    text: str | None = None          # output text when a decoder is given (cut at a stop string)
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    num_prefix_reused: int = 0       # prompt positions whose target KV was copied, not computed (prefix.py)
    num_forced: int = 0              # committed tokens forced by the grammar (response_format)
    rng: object = None               # engine-owned per-sequence generators
    guide: object = None             # engine-owned grammar state when params.response_format is set
    _stop_scan_from: int = 0         # stop-string search resumes here (chars)
    _stop_barrier: int = 0           # a stop string must end past this char (its grammar accepted there)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_id(self) -> int:
        """The last committed token (the next round's first input), without copying the history."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def commit(self, tokens: Seq[int], eos_ids: Seq[int], max_model_len: int,
               decode: Callable[[list[int]], str] | None = None, may_stop: Seq[bool] | None = None) -> int:
        """Append tokens one at a time, stopping at the first stop condition. Returns how many were
        committed; sets status/finish_reason when the sequence ends. may_stop[i] (a grammar's
        verdict after tokens[i]: it accepts there) gates stop strings and stop token ids; EOS needs
        no gate (a grammar allows it only where it accepts)."""
        for n, tok in enumerate(tokens, start=1):
            self.output_ids.append(int(tok))
            reason = self._stop_reason(int(tok), eos_ids, max_model_len, decode,
                                       True if may_stop is None else may_stop[n - 1])
            if reason is not None:
                self.finish(reason)
                return n
        return len(tokens)

    def _stop_reason(self, tok: int, eos_ids, max_model_len: int, decode, may_stop: bool) -> str | None:
        if may_stop and tok in self.params.stop_token_ids:
            return "stop"
        if tok in eos_ids and not self.params.ignore_eos:
            return "eos"
        if self.params.stop and decode is not None:
            if may_stop and self._hit_stop_string(decode):
                return "stop"
            if not may_stop:               # no stop string may end here or before
                self._stop_barrier = len(decode(self.output_ids))
        if len(self.output_ids) >= self.params.max_tokens:
            return "length"
        if self.num_tokens >= max_model_len:
            return "context"
        return None

    def _hit_stop_string(self, decode: Callable[[list[int]], str]) -> bool:
        text = decode(self.output_ids)
        start = self._stop_scan_from
        hits = [i for i in (text.find(s, max(start, self._stop_barrier - len(s) + 1)) for s in self.params.stop)
                if i >= 0]
        if hits:
            self.text = text[:min(hits)]
            return True
        longest = max(len(s) for s in self.params.stop)
        # A stop string can straddle tokens: rescan the last len-1 characters next time. A trailing
        # incomplete UTF-8 char decodes as U+FFFD and may change; back off one more char for it.
        self._stop_scan_from = max(0, len(text) - longest)
        return False

    def finish(self, reason: str) -> None:
        assert reason in FINISH_REASONS, reason
        self.status, self.finish_reason = Status.FINISHED, reason

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
