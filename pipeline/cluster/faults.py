"""Failure drills injected into a generation worker, a tensor-parallel rank or the driver: a fault
plan built from the job's `debug.*` keys and the place it runs (a worker's index and incarnation, a
rank, the driver).

The worker calls the plan's hooks at fixed points (`on_start`, `on_load`, `after_step`, `before_commit`),
a rank `on_rank_load`, `on_rank_build` and `after_rank_step`, the driver `holds_dispatch` before it hands
out units; at the debug defaults every hook does nothing. A rank told to stop sends itself SIGSTOP: its
process frozen with its sockets open, as a hung process or a partitioned node leaves them. Only the first incarnation of worker 0 hangs or crashes on a step count or
at load, so its replacement finishes the job; `crash_before_commit` hits every worker.

Knows DebugConfig and how to die, hang, stop or wait like a broken or held process; knows nothing about
engines, units or the output layout.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

from ..job.config import DebugConfig

EXIT_CODE = 17                              # a drill's exit status (any non-zero one would do)
STOP_AFTER_STEPS = 3                        # stop_rank_in "step": after this many steps


@dataclass(frozen=True)
class FaultPlan:
    """What this worker does wrong; all fields at their defaults: nothing."""
    hang_load: bool = False                 # load() never returns
    start_delay_s: float = 0                # the actor's constructor sleeps this long
    crash_after_steps: int = 0              # exit after this many engine steps (0: never)
    hang_after_steps: int = 0               # the engine loop stops after this many steps (0: never)
    crash_before_commit: bool = False       # exit after writing a unit's data, before its marker
    crash_rank_after_steps: int = 0         # a tensor-parallel rank: exit after this many steps (0: never)
    stop_rank_in: str = ""                  # a tensor-parallel rank stops (SIGSTOP) in this phase (job.config.RANK_PHASES)
    rank_build_delay_s: float = 0           # a tensor-parallel rank's runner build sleeps this long (a slow one)
    hold_dispatch_file: str = ""            # the driver: no unit handed out while this file exists

    @classmethod
    def from_config(cls, debug: DebugConfig, index: int, incarnation: int) -> FaultPlan:
        first_w0 = index == 0 and incarnation == 0
        return cls(hang_load=debug.hang_load and first_w0, start_delay_s=debug.start_delay_s if first_w0 else 0,
                   crash_after_steps=debug.crash_worker_after_steps if first_w0 else 0,
                   hang_after_steps=debug.hang_worker_after_steps if first_w0 else 0,
                   crash_before_commit=debug.crash_before_commit)

    @classmethod
    def for_rank(cls, debug: DebugConfig, index: int, incarnation: int, rank: int, size: int) -> FaultPlan:
        """A tensor-parallel rank's plan (ranks 1..N-1): the last rank of worker 0's first incarnation
        may die after a step count or stop in a phase."""
        last_of_first_w0 = index == 0 and incarnation == 0 and rank == size - 1
        return cls(crash_rank_after_steps=debug.crash_rank_after_steps if last_of_first_w0 else 0,
                   stop_rank_in=debug.stop_rank_in if last_of_first_w0 else "")

    @classmethod
    def for_driver(cls, debug: DebugConfig) -> FaultPlan:
        """The driver's plan: its dispatch may be held by a file."""
        return cls(hold_dispatch_file=debug.hold_dispatch_file)

    def holds_dispatch(self) -> bool:
        """Asked by the driver before it hands out units: True while the hold file exists."""
        return bool(self.hold_dispatch_file) and os.path.exists(self.hold_dispatch_file)

    def on_rank_load(self) -> None:
        """Called by a tensor-parallel rank as it starts loading (its heartbeat already running)."""
        if self.stop_rank_in == "load":
            stop_now()

    def on_rank_build(self) -> None:
        """Called by a tensor-parallel rank as it starts building its runner (it has joined the replica)."""
        if self.stop_rank_in == "build":
            stop_now()
        if self.rank_build_delay_s:
            time.sleep(self.rank_build_delay_s)     # slow, still beating (a busy machine measuring kernels)

    def after_rank_step(self, steps: int) -> None:
        """Called by a tensor-parallel rank after each step it ran."""
        if self.crash_rank_after_steps and steps >= self.crash_rank_after_steps:
            exit_now()
        if self.stop_rank_in == "step" and steps == STOP_AFTER_STEPS:
            stop_now()

    def on_start(self) -> None:
        if self.start_delay_s:
            time.sleep(self.start_delay_s)  # a process slow to start (a loaded node)

    def on_load(self) -> None:
        if self.hang_load:
            hang()                          # a load that never returns

    def after_step(self, steps: int) -> None:
        """Called by the engine loop after each step, with the steps taken so far."""
        if self.crash_after_steps and steps >= self.crash_after_steps:
            exit_now()
        if self.hang_after_steps and steps >= self.hang_after_steps:
            hang()                          # an engine loop that stops

    def before_commit(self) -> None:
        """Called by the writer after a unit's data is staged and before its marker is written."""
        if self.crash_before_commit:
            exit_now()


def exit_now() -> None:
    """Die like a killed process (no cleanup, no exception)."""
    os._exit(EXIT_CODE)


def stop_now() -> None:
    """Freeze this process (SIGSTOP): every thread stops, its sockets stay open; SIGCONT or SIGKILL ends it."""
    os.kill(os.getpid(), signal.SIGSTOP)


def hang() -> None:
    """Block this thread forever."""
    threading.Event().wait()
