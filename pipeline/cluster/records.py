"""Rows out: an engine step's rounds and finished sequences, turned into rows of the `rounds` and
`completions` tables and filed under the unit each request came from.

Knows the engine's records (RoundRecord, Completion) and the output columns; knows nothing about
threads, reading rows, committing or Ray.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..job.validity import structured_columns
from ..io.reader import Unit
from ..job.config import JobConfig
from .feeding import UnitState

if TYPE_CHECKING:
    from ..engine import Completion, RoundRecord


class Recorder:
    """Files each step's output under its units; counts tokens and finished rows in `stats`."""

    def __init__(self, cfg: JobConfig, config_hash: str, worker: str, loaded, stats: dict):
        self.worker, self.stats = worker, stats
        self.stamp = {"target_model": loaded.target_id, "draft_model": loaded.draft_id,   # on every completion
                      "model_dtype": loaded.dtype.dtype, "drafter": cfg.drafting.method,
                      "config_hash": config_hash, "run_id": cfg.run.run_id}

    def route(self, out, active: list[UnitState]) -> None:
        """One step's output (rounds, finished) -> rows of the units that own its requests."""
        owner = {rid: s for s in active for rid in s.pending}
        for r in out.rounds:
            state = owner[r.request_id]
            state.rounds.append({**self.round_row(r, state.unit.uid), **state.passthrough[r.request_id]})
            self.stats["tokens"] += r.emitted
            self.stats["drafted"] += r.draft_len
            self.stats["accepted"] += r.accepted
        for c in out.finished:
            state = owner[c.request_id]
            index, queued = state.pending.pop(c.request_id)
            state.prompt_tokens_reused += c.prompt_tokens_reused
            state.completions.append({**self.completion_row(c, state.unit, index, time.perf_counter() - queued),
                                      **state.passthrough.pop(c.request_id)})
            self.stats["rows"] += 1

    def round_row(self, r: RoundRecord, uid: str) -> dict:
        return round_row(r, self.worker, uid)

    def completion_row(self, c: Completion, unit: Unit, index: int, latency: float) -> dict:
        return completion_row(c, self.stamp, self.worker, unit.uid, unit.file, index, latency)


def round_row(r: RoundRecord, worker: str, uid: str) -> dict:
    """A row of the rounds table."""
    return {"id": r.request_id, "round": r.round, "draft_len": r.draft_len, "accepted": r.accepted,
            "emitted": r.emitted, "accepted_mask": list(r.accepted_mask),
            "first_rejected": r.first_rejected, "batch_size": r.batch_size,
            "draft_s": r.draft_s, "verify_s": r.verify_s, "step": r.step, "forced": r.forced,
            "forced_accepted": r.forced_accepted, "paths": r.paths, "worker": worker, "unit": uid}


def completion_row(c: Completion, stamp: dict, worker: str, uid: str, source_file: str | None,
                   index: int | None, latency: float) -> dict:
    """A row of the completions table; `stamp`: the run's columns (models, dtype, drafter, config hash, run id)."""
    n = len(c.output_ids)
    return {"id": c.request_id, "text": c.text, "token_ids": c.output_ids, "finish_reason": c.finish_reason,
            "prompt_tokens": c.prompt_len, "completion_tokens": n, "rounds": c.num_rounds,
            "draft_tokens": c.num_draft_tokens, "accepted_tokens": c.num_accepted,
            **acceptance(c), "seed": c.seed,
            **stamp, "unit": uid, "source_file": source_file,
            "source_row": index, "worker": worker, "latency_s": latency,
            **structured_columns(c)}


def acceptance(c: Completion) -> dict:
    """A completion's acceptance_rate (accepted / drafted; null when nothing was drafted) and
    mean_accepted_length (committed tokens per round)."""
    return {"acceptance_rate": c.num_accepted / c.num_draft_tokens if c.num_draft_tokens else None,
            "mean_accepted_length": len(c.output_ids) / c.num_rounds if c.num_rounds else None}
