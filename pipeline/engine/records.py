"""What the engine hands out: a record per row per round (RoundRecord), a completion per finished
request (Completion), and a step's batch of both (StepOutput); and the builders that fill them from
a committed round or a finished sequence, counting each row's rounds, drafts and accepted tokens.

Knows a committed step's readback and a sequence's counts; nothing of models, scheduling or how
the tokens were chosen.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .core.request import Sequence
from .core.tree import num_leaves

if TYPE_CHECKING:
    from .core.verify import HostVerifyOutput
    from .launch import Launched


@dataclass
class RoundRecord:
    request_id: str
    round: int                       # 0-based round index of this sequence
    draft_len: int                   # g proposed
    accepted: int                    # leading draft tokens accepted
    emitted: int                     # tokens committed this round (accepted + recovered/bonus, cut at stops)
    accepted_mask: list[bool]        # per draft position
    batch_size: int                  # running sequences in this step
    draft_s: float                   # the step's draft phase, seconds
    verify_s: float                  # the step's verify phase (target forward + verification)
    step: int = 0                    # engine step index (rounds of one step share it)
    forced: int = 0                  # of draft_len: forced by the row's grammar, not drafted
    forced_accepted: int = 0         # of accepted: forced ones
    paths: int = 0                   # root-to-leaf paths in the draft: 1 a single path, more a token tree
                                     # (draft_len its size, accepted the depth of its accepted path)
    rejected: bool = False           # a draft token after the accepted ones was rejected (the round's last
                                     # token was recovered, not a bonus)

    @property
    def first_rejected(self) -> int | None:
        """The draft position (a tree: the depth) of the rejection, or None when there was none."""
        return self.accepted if self.rejected else None


@dataclass
class Completion:
    request_id: str
    prompt_len: int
    output_ids: list[int]
    text: str | None
    finish_reason: str
    seed: int
    num_rounds: int
    num_draft_tokens: int
    num_accepted: int
    prompt_tokens_reused: int = 0    # prompt positions whose KV was copied from a slot (prefix reuse)
    response_format: str | None = None   # the row's constraint (canonical JSON) or None
    valid: bool | None = None        # constrained rows: the grammar ended the output (EOS or a stop
                                     # where it accepts); False when max_tokens or the context ran out
    num_forced: int = 0              # committed tokens that were forced by the grammar


@dataclass
class StepOutput:
    finished: list[Completion] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)


def round_record(step: Launched, out: HostVerifyOutput, b: int, seq: Sequence, emitted: int, mask,
                 rejected: bool, verify_s: float, step_index: int) -> RoundRecord:
    """Row b's round record (mask: its drafts' accepted flags), and its counts (rounds, drafted,
    accepted, forced tokens committed)."""
    drafts, g, k = step.guided.drafts, step.guided.drafts.num_draft[b], out.num_accepted[b]
    forced = step.guided.forced_rows(b)
    record = RoundRecord(
        request_id=seq.request_id, round=seq.num_rounds, draft_len=g, accepted=k, emitted=emitted,
        accepted_mask=mask, batch_size=len(step.batch), draft_s=step.draft_s,
        verify_s=verify_s, step=step_index, forced=len(forced),
        forced_accepted=sum(1 for i in forced if i < k),              # as `accepted` counts them
        paths=num_leaves(drafts.parents[b]) if drafts.is_tree else int(g > 0), rejected=rejected)
    seq.num_forced += sum(1 for i in forced if i < min(k, emitted))   # committed ones
    seq.num_rounds += 1
    seq.num_draft_tokens += g
    seq.num_accepted += k
    return record


def completion(seq: Sequence, decode: Callable[[list[int]], str] | None) -> Completion:
    """A finished sequence's completion (its text decoded here where the stops did not already)."""
    text = seq.text
    if text is None and decode is not None:
        text = decode(seq.output_ids)
    constrained = seq.params.response_format is not None
    return Completion(
        request_id=seq.request_id, prompt_len=len(seq.prompt_ids), output_ids=list(seq.output_ids), text=text,
        finish_reason=seq.finish_reason, seed=seq.seed, num_rounds=seq.num_rounds,
        num_draft_tokens=seq.num_draft_tokens, num_accepted=seq.num_accepted,
        prompt_tokens_reused=seq.num_prefix_reused, response_format=seq.params.response_format,
        valid=seq.finish_reason in ("eos", "stop") if constrained else None, num_forced=seq.num_forced)
