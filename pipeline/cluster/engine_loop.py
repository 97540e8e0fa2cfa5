"""The engine loop: the one thread that steps a worker's engine.

Each turn: take queued units (blocking only when the engine has nothing to do and no unit has rows
left to feed or is done), feed rows up to the backlog, step the engine once if it has work and file
the step's output under the units, then hand every done unit to `finish` (the worker's writer thread). Only this thread touches
the engine and the active units' state, until a done unit is handed over; other threads reach it only
through `submit` (a queue). If a turn raises, the loop dies: `on_death` hears the error first, then
every unit still active fails with WorkerBroken.

Knows the engine's step API and the order of a turn; knows nothing about reading rows, output
columns, storage or Ray.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from ..io.reader import Unit
from .faults import FaultPlan
from .feeding import RowFeeder, UnitState
from .records import Recorder


class WorkerBroken(RuntimeError):
    """The worker cannot run units any more (its models did not load, or its engine loop died): the
    driver replaces the actor rather than retrying units on it."""


class EngineLoop:
    def __init__(self, engine, feeder: RowFeeder, recorder: Recorder, finish: Callable[[UnitState], None],
                 *, stats: dict, metrics, faults: FaultPlan, num_threads: int, worker: str,
                 on_death: Callable[[BaseException], None]):
        self.engine, self.feeder, self.recorder, self.finish = engine, feeder, recorder, finish
        self.stats, self.metrics, self.faults = stats, metrics, faults   # stats: steps, step_s here
        self.num_threads, self.worker, self.on_death = num_threads, worker, on_death
        self._inbox: queue.Queue = queue.Queue()

    def start(self) -> None:
        threading.Thread(target=self._run, name="engine-loop", daemon=True).start()

    def submit(self, unit: Unit, future: Future) -> None:
        """Queue a unit (any thread); its future resolves when it is committed or fails."""
        self._inbox.put((unit, future))

    def _run(self) -> None:
        import torch
        # OpenMP thread counts are per thread: a new thread starts from OMP_NUM_THREADS (Ray sets it),
        # whatever torch.get_num_threads() reports, so set it again here.
        torch.set_num_threads(self.num_threads)
        active: list[UnitState] = []
        try:
            while True:
                self._turn(active)
        except BaseException as e:  # noqa: BLE001 -- every in-flight unit must hear about it
            self.on_death(e)
            broken = WorkerBroken(f"worker {self.worker}: engine loop died: {type(e).__name__}: {e}")
            for state in active:
                state.future.set_exception(broken)

    def _turn(self, active: list[UnitState]) -> None:
        engine = self.engine
        self._take_units(active, block=not engine.has_unfinished() and not _feedable(active))
        self.feeder.feed(active)
        if engine.has_unfinished():
            self._step(active)
        else:
            self.metrics.maybe_flush()
        for state in [s for s in active if s.is_done]:
            active.remove(state)
            self.finish(state)

    def _step(self, active: list[UnitState]) -> None:
        t0 = time.perf_counter()
        out = self.engine.step()
        self.stats["step_s"] += time.perf_counter() - t0
        self.recorder.route(out, active)
        self.stats["steps"] += 1
        self.metrics.on_step(out, self.engine.num_running, self.engine.num_waiting)
        self.faults.after_step(self.stats["steps"])

    def _take_units(self, active: list[UnitState], block: bool) -> None:
        while True:
            try:
                unit, future = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            active.append(self.feeder.open(unit, future))
            block = False


def _feedable(active: list[UnitState]) -> bool:
    """Some unit has rows left to read, or is done (and waits to be handed over)."""
    return any(not s.is_exhausted or s.is_done for s in active)
