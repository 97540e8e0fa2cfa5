"""Steps run ahead (engine.run_ahead): a layer over the round that a reader of the plain round can skip.

Where the target's verify steps run in captured graphs (a GPU), a step without drafts emits one token
per row on the device. The next step can then be launched before this one is read back: its rows'
last committed tokens stay on the device (`Carry`) and the device never waits for the host's commit.
The committed tokens are those of steps that wait. Not run ahead: steps with drafts, rows that need
their tokens on the host first (a grammar's mask, penalty counts) and rows that end by their length
at this step; a row that ends by EOS or a stop drops the step launched for it.

On CPU (no graphs, or engine.run_ahead off) `RunAhead` does nothing: every step is launched after the
previous one's commit.

Knows the round's admit, draft and launch as functions it is given; nothing of drafting or verification.
"""
from __future__ import annotations

from typing import Callable

from .config import AUTO
from .core.request import Sequence
from .launch import Carry, Launched


class RunAhead:
    """The step launched ahead of the current one's readback, if any."""

    def __init__(self, target, mode: str, max_model_len: int, drafter, admit: Callable[[], None],
                 running: Callable[[], list[Sequence]], draft: Callable, launch: Callable[..., Launched]):
        """target: the target's runner; mode: engine.run_ahead; drafter: the engine's (only a step of the
        `none` drafter runs ahead); admit, running, draft, launch: the round's own stages (SpecEngine._admit,
        the running rows, _draft, _launch)."""
        self.target, self.max_model_len, self.drafter = target, max_model_len, drafter
        self.admit, self.running, self.draft, self.launch = admit, running, draft, launch
        self.enabled = self._policy(mode)
        self.num_steps = 0                  # steps launched before the previous one was read back
        self.pending: Launched | None = None

    def _policy(self, mode: str) -> bool:
        """engine.run_ahead: auto where the target's verify steps run in captured graphs; on where they run
        in its step graphs, captured or not."""
        target = self.target
        possible = target.graphs is not None and target.kernels.graph_verify
        if mode == "on" and not possible:
            raise ValueError("engine.run_ahead=on: the target's verify steps do not run in step graphs "
                             "(engine.cuda_graphs off or unavailable); set engine.run_ahead to auto or off")
        return possible and (mode == "on" or (mode == AUTO and target.graphs.capture is not None))

    def take(self) -> Launched | None:
        """The step launched during the previous one, which this step reads back."""
        step, self.pending = self.pending, None
        if step is not None:
            self.num_steps += 1
        return step

    def launch_after(self, step: Launched) -> None:
        """Launch the next step now, before `step` is read back, where that is allowed."""
        if self.enabled and self._may_follow(step):
            self.pending = self._launch_next(step)

    def drop_ended(self) -> None:
        """Forget the step launched ahead when every row it runs ended at this commit."""
        if self.pending is not None and all(s.is_finished for s in self.pending.batch):
            self.pending = None

    def _may_follow(self, step: Launched) -> bool:
        """`step` ran in a graph and proposes nothing (one token per row, on the device), and no row needs
        its tokens on the host first or ends by its length here."""
        graphs = self.target.graphs
        if not (step.readback is not None and graphs.enabled and graphs.tails_enabled
                and self.drafter.kind == "none" and not any(step.guided.drafts.num_draft)):
            return False
        room = self.max_model_len
        return all(plain(s) and s.params.max_tokens - len(s.output_ids) >= 2 and room - s.num_tokens >= 2
                   for s in step.batch)

    def _launch_next(self, step: Launched) -> Launched | None:
        """Free slots admitted (their prompts' chunks queued behind `step`), then every running row, those
        of `step` taking its emitted token from the device. None where a newly admitted row needs its
        grammar or penalties (the next step then runs after this one's commit)."""
        self.admit()
        batch = self.running()
        if not all(plain(s) for s in batch):
            return None
        return self.launch(batch, *self.draft(batch), carry=Carry.of(batch, step))


def plain(seq: Sequence) -> bool:
    """A row whose next step needs nothing of its last token on the host."""
    return seq.guide is None and not seq.params.has_penalties
