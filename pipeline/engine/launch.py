"""A step launched on the target, and the rows it carries from the step before.

`Launched` is what the round keeps between launching a verify step and reading it back: its rows,
their drafts, each row's first position and inputs, the readback. `Carry` exists only where steps run
ahead (ahead.py): the rows a step shares with the step launched just before it, whose last committed
token is still on the device.

Knows the verifier's readback and the drafts' layout; nothing of models, scheduling or policies.
"""
from __future__ import annotations

from dataclasses import dataclass

from .core.request import Sequence
from .core.verify import HostVerifyOutput
from .core.verify_step import Readback
from .drafting.guided import GuidedDraft
from .grammar.walk import RoundWalk


@dataclass
class Launched:
    """A step launched on the target: its rows, their drafts, each row's first position and inputs, and
    its readback (None where the verifier ran after an eager forward: its output is `out`)."""
    batch: list[Sequence]
    guided: GuidedDraft
    walk: RoundWalk | None
    starts: list[int]
    inputs: list[list[int]]
    draft_s: float
    catch_up_s: float
    launch_s: float
    readback: Readback | None = None
    out: HostVerifyOutput | None = None


@dataclass
class Carry:
    """The rows a step shares with `before`, the step launched just ahead of it and not yet read back:
    their last committed token is the one `before` emits, still on the device."""
    before: Launched
    pairs: list[tuple[int, int]]       # (row in this step, row in `before`)

    @classmethod
    def of(cls, batch: list[Sequence], before: Launched) -> "Carry":
        where = {id(s): i for i, s in enumerate(before.batch)}
        return cls(before, [(b, where[id(s)]) for b, s in enumerate(batch) if id(s) in where])

    def place(self, starts: list[int], last: list[int]) -> None:
        """Each carried row's first position follows `before`'s inputs; its token is a placeholder."""
        for b, i in self.pairs:
            starts[b] = self.before.starts[i] + len(self.before.inputs[i])
            last[b] = 0

    def on_device(self) -> tuple:
        """What a graph takes the carried tokens from: (`before`'s first tokens on the device, pairs)."""
        return self.before.readback.first_tokens, self.pairs

    def fill(self, inputs: list[list[int]]) -> None:
        """No graph takes this step: the carried tokens are read back first and put in the inputs."""
        emitted = self.before.readback.result().output_ids
        for b, i in self.pairs:
            inputs[b][0] = emitted[i][0]
