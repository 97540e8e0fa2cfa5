"""Commit a finished unit: check that every planned row came back (as a completion or an error), build
its three tables and its marker, write them through RunOutput, and resolve the unit's future with the
marker (or with the error: the driver re-queues the unit).

Runs on the worker's writer thread while the engine keeps decoding. Knows the output tables and the
marker's fields; knows nothing about engines, threads or Ray.
"""
from __future__ import annotations

import collections
import time

from ..io.schema import to_table
from ..io.writer import RunOutput
from ..job.config import JobConfig
from .faults import FaultPlan
from .feeding import UnitState


class UnitCommitter:
    """Writes finished units to one run's output, exactly once each (the marker is the commit)."""

    def __init__(self, cfg: JobConfig, worker: str, output: RunOutput, faults: FaultPlan, stats: dict, metrics):
        self.cfg, self.worker, self.output, self.faults = cfg, worker, output, faults
        self.stats, self.metrics = stats, metrics     # stats["units"] counts commits

    def __call__(self, state: UnitState) -> None:
        try:
            _check_complete(state)
            committed = self.output.write_unit(state.unit.uid, self._tables(state), self._marker(state),
                                               before_commit=self.faults.before_commit)
            self.metrics.on_commit()                    # flushed before the driver hears of the commit
            state.future.set_result(committed)
            self.stats["units"] += 1
        except BaseException as e:  # noqa: BLE001 -- reported to the driver through the unit's call
            state.future.set_exception(e)

    def _tables(self, state: UnitState) -> dict:
        extra = self.cfg.input.passthrough_columns
        return {"completions": to_table("completions", state.completions, extra),
                "rounds": to_table("rounds", state.rounds, extra),
                "errors": to_table("errors", state.errors, extra)}

    def _marker(self, state: UnitState) -> dict:
        unit, done = state.unit, state.completions
        return {"rows": unit.num_rows, "completions": len(done), "errors": len(state.errors),
                "tokens": sum(c["completion_tokens"] for c in done),
                "draft_tokens": sum(c["draft_tokens"] for c in done),
                "accepted_tokens": sum(c["accepted_tokens"] for c in done),
                "prompt_tokens": sum(c["prompt_tokens"] for c in done),
                "prompt_tokens_reused": state.prompt_tokens_reused,
                "structured": sum(c["valid"] is not None for c in done),
                "valid": sum(c["valid"] is True for c in done),
                "forced_tokens": sum(c["forced_tokens"] for c in done),
                "rounds": len(state.rounds), "worker": self.worker,
                "error_reasons": dict(collections.Counter(e["reason"] for e in state.errors)),
                "source_file": unit.file, "start": unit.start, "stop": unit.stop,
                "wall_s": round(time.time() - state.started, 3), "committed_at": time.time()}


def _check_complete(state: UnitState) -> None:
    """Raise unless the unit's rows were all read and each came back once."""
    unit = state.unit
    if state.failure is not None:
        raise RuntimeError(f"unit {unit.uid}: reading {unit.file} failed: "
                           f"{type(state.failure).__name__}: {state.failure}") from state.failure
    if len(state.completions) + len(state.errors) != unit.num_rows or state.num_rows != unit.num_rows:
        raise RuntimeError(f"unit {unit.uid}: {unit.num_rows} rows planned, {state.num_rows} read, "
                           f"{len(state.completions)} completions + {len(state.errors)} errors")
