"""Timing several calls side by side on a machine others may be using: each round times every call
once, the rounds in turn, so a stretch where the machine is busy elsewhere slows one timing of each
call rather than every timing of one; the median of a call's rounds is its time.

Used by the kernel plans (backends/cpu/calibrate.py) and the adaptive policy's cost curves
(drafting/cost.py). `Stopwatch` times the engine's phases: the seconds spent inside its `with` blocks.
No torch import.
"""
from __future__ import annotations

import time
from typing import Callable


def interleaved(calls: list[Callable[[], object]], repeats: int, warmups: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Median seconds of each call, in order: `warmups` untimed rounds, then `repeats` timed ones."""
    laps: list[list[float]] = [[] for _ in calls]
    for rep in range(warmups + repeats):
        for lap, call in zip(laps, calls):
            t0 = clock()
            call()
            if rep >= warmups:
                lap.append(clock() - t0)
    return [sorted(lap)[len(lap) // 2] for lap in laps]


class Stopwatch:
    """Seconds spent inside `with` blocks of it, summed in `s` (one block: its duration)."""

    def __init__(self):
        self.s = 0.0

    def __enter__(self) -> "Stopwatch":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s += time.perf_counter() - self._start
