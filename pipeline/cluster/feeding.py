"""Rows in: a unit's state while the engine works on it, and the feeder that turns its rows into
engine requests or error rows.

Rows are read only as the engine drains: the feeder keeps at most `engine.max_num_seqs` requests
waiting, so a unit's file is read one record batch at a time, between engine steps. A row the engine
cannot take becomes an error row at once; a unit whose file cannot be read is marked failed and the
other units go on.

Knows the reader, the row -> request mapping and the engine's admission API; knows nothing about
threads, engine steps, committing or Ray.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..engine import RequestError
from ..io.reader import Unit, iter_rows
from ..job.config import JobConfig
from ..job.rows import RowError, default_id, job_columns, passthrough, row_request


@dataclass
class UnitState:
    unit: Unit
    future: Future
    rows: object                                      # iterator of (index, row)
    is_exhausted: bool = False
    pending: dict = field(default_factory=dict)       # request id -> (source row, time queued)
    passthrough: dict = field(default_factory=dict)   # request id -> its input.passthrough_columns values
    completions: list = field(default_factory=list)
    rounds: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    num_rows: int = 0
    prompt_tokens_reused: int = 0                     # of its finished rows (prefix reuse; not a column)
    started: float = field(default_factory=time.time)
    failure: BaseException | None = None              # reading its rows failed: the unit fails, the worker lives

    @property
    def is_done(self) -> bool:
        return self.is_exhausted and not self.pending


class RowFeeder:
    """Reads units' rows into one engine, as its queue of waiting requests drains."""

    def __init__(self, cfg: JobConfig, config_hash: str, loaded, stats: dict, metrics):
        self.cfg, self.config_hash = cfg, config_hash
        self.columns = job_columns(cfg.input)
        self.engine, self.tokenizer = loaded.engine, loaded.tokenizer
        self.stats, self.metrics = stats, metrics     # stats["rows"] counts error rows here

    def open(self, unit: Unit, future: Future) -> UnitState:
        """A unit's state, its rows not read yet."""
        return UnitState(unit, future, iter_rows(unit, self.cfg.storage))

    def feed(self, active: list[UnitState]) -> None:
        """Keep a backlog of max_num_seqs queued requests: rows are read only as the engine drains."""
        for state in active:
            while not state.is_exhausted and self.engine.num_waiting < self.engine.config.max_num_seqs:
                try:
                    item = next(state.rows, None)
                except Exception as e:  # noqa: BLE001 -- storage: this unit fails, the others go on
                    state.failure, item = e, None
                if item is None:
                    state.is_exhausted = True
                else:
                    self._add_row(state, *item)

    def _add_row(self, state: UnitState, index: int, row: dict) -> None:
        cfg, unit = self.cfg, state.unit
        state.num_rows += 1
        fallback_id = default_id(unit.rel, index)
        try:
            if index in unit.duplicate_rows:
                raise RowError("duplicate_id", cfg.input.id_column,
                               f"id {row.get(cfg.input.id_column)!r} appeared in an earlier row")
            req = row_request(row, self.columns, cfg.sampling, cfg.run.seed, self.tokenizer, fallback_id)
            self.engine.add_request(req.id, req.prompt_ids, req.params, req.seed)
        except RowError as e:
            return self._error_row(state, index, row, fallback_id, e.reason, e.field, e.message)
        except RequestError as e:
            refused = RowError.of(e)
            return self._error_row(state, index, row, req.id, refused.reason, refused.field, refused.message)
        state.pending[req.id] = (index, time.perf_counter())
        state.passthrough[req.id] = passthrough(row, cfg.input)

    def _error_row(self, state, index, row, fallback_id, reason, field_name, message) -> None:
        rid = row.get(self.cfg.input.id_column) if isinstance(row, dict) else None
        state.errors.append({
            "id": str(rid) if rid is not None and reason != "missing_id" else fallback_id,
            "reason": reason, "field": field_name, "message": message, "source_file": state.unit.file,
            "source_row": index, "unit": state.unit.uid, "run_id": self.cfg.run.run_id,
            "config_hash": self.config_hash, **passthrough(row, self.cfg.input)})
        self.stats["rows"] += 1
        self.metrics.on_error_row(reason)
