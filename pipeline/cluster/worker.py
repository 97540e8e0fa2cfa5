"""The generation worker: a Ray actor holding one engine (target + draft) that turns units into
committed output.

`run_unit(unit)` returns once the unit is committed. The driver keeps `units_in_flight` calls
outstanding per actor; the actor is threaded, so those calls only queue units for one engine loop
thread, which reads rows as the engine's backlog drains (the next unit's rows are admitted while the
current one's last sequences still decode: batches stay full at unit boundaries). A finished unit is
written by a writer thread while the engine keeps decoding.

Knows the engine, rows and the output layout; knows nothing about planning, retries or progress bars
(the driver's job).
"""
from __future__ import annotations

import collections
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from ..engine import Completion, RequestError, RoundRecord
from ..io.reader import Unit, iter_rows
from ..io.schema import to_table
from ..io.writer import RunOutput
from ..job.config import JobConfig, config_hash
from ..job.rows import RowError, default_id, passthrough, row_request
from .metrics import WorkerMetrics


@dataclass
class _UnitState:
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


class WorkerBroken(RuntimeError):
    """The worker cannot run units any more (its models did not load, or its engine loop died): the
    driver replaces the actor rather than retrying units on it."""


class GenerationWorker:
    def __init__(self, cfg: JobConfig, name: str, index: int = 0, incarnation: int = 0):
        self.cfg, self.name, self.index, self.incarnation = cfg, name, index, incarnation
        self.config_hash = config_hash(cfg)
        self._inbox: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stats = {"rows": 0, "tokens": 0, "drafted": 0, "accepted": 0, "steps": 0, "units": 0,
                       "step_s": 0.0}
        self._metrics = WorkerMetrics(name, cfg.run.run_id, enabled=False)    # a no-op until load()

    # ---- actor methods --------------------------------------------------------------------------
    def ping(self) -> str:
        """Answers as soon as the actor is placed and constructed (the driver's placement check)."""
        return self.name

    def load(self) -> dict:
        """Load models, build the engine and start its loop. Returns model ids and load time. If it
        raises, every later run_unit raises WorkerBroken (no call waits forever)."""
        try:
            return self._load()
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._ready.set()

    def _load(self) -> dict:
        import torch

        from ..job.runtime import build_engine
        if self.cfg.debug.hang_load and self._is_first_w0:
            threading.Event().wait()                    # drill: a load that never returns
        t0 = time.perf_counter()
        # Rows are tokenized between engine steps: the tokenizer's own thread pool would spin on the
        # cores the model's OpenMP threads are using (measured: +50% step time at 2 threads/2 cores).
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        torch.set_num_threads(self._threads)
        self.loaded = build_engine(self.cfg.models, self.cfg.engine)
        self.output = RunOutput(self.cfg.output.path, self.cfg.run.run_id, self.cfg.storage,
                                self.cfg.output.compression)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="unit-writer")
        self._metrics = WorkerMetrics(self.name, self.cfg.run.run_id, enabled=self.cfg.run.metrics)
        threading.Thread(target=self._loop, name="engine-loop", daemon=True).start()
        return {"worker": self.name, "target": self.loaded.target_id, "draft": self.loaded.draft_id,
                "dtype": self.loaded.dtype.dtype, "dtype_reason": self.loaded.dtype.reason,
                "draft_dtype": self.loaded.draft_dtype.dtype if self.loaded.draft_dtype else None,
                "load_s": round(time.perf_counter() - t0, 2), "pid": os.getpid()}

    def run_unit(self, unit: Unit) -> dict:
        """Queue a unit and block (this call's thread only) until it is committed; returns its marker."""
        self._ready.wait()
        if self._error is not None:
            raise WorkerBroken(f"worker {self.name} is broken: {type(self._error).__name__}: {self._error}")
        future: Future = Future()
        self._inbox.put((unit, future))
        while True:
            try:
                return future.result(timeout=5)
            except FutureTimeout:
                if self._error is not None:             # the loop died after this unit was queued
                    raise WorkerBroken(f"worker {self.name}: engine loop died: {self._error!r}") from None

    def stats(self) -> dict:
        return {**self._stats, "worker": self.name}

    # ---- the engine loop --------------------------------------------------------------------------
    @property
    def _threads(self) -> int:
        return max(1, int(self.cfg.cluster.num_cpus_per_worker))

    def _loop(self) -> None:
        import torch
        # OpenMP thread counts are per thread: a new thread starts from OMP_NUM_THREADS (Ray sets it),
        # whatever torch.get_num_threads() reports, so set it again here.
        torch.set_num_threads(self._threads)
        engine, active = self.loaded.engine, []
        try:
            while True:
                self._take_units(active, block=not engine.has_unfinished() and not self._feedable(active))
                self._feed(active)
                if engine.has_unfinished():
                    t0 = time.perf_counter()
                    out = engine.step()
                    self._stats["step_s"] += time.perf_counter() - t0
                    self._route(out, active)
                    self._metrics.on_step(out, engine.num_running, engine.num_waiting)
                    self._drill_crash_after_steps()
                else:
                    self._metrics.maybe_flush()
                for state in [s for s in active if s.is_done]:
                    active.remove(state)
                    self._writer.submit(self._commit, state)
        except BaseException as e:  # noqa: BLE001 -- every in-flight unit must hear about it
            self._error = e
            broken = WorkerBroken(f"worker {self.name}: engine loop died: {type(e).__name__}: {e}")
            for state in active:
                state.future.set_exception(broken)

    @staticmethod
    def _feedable(active: list[_UnitState]) -> bool:
        return any(not s.is_exhausted or s.is_done for s in active)

    def _take_units(self, active: list[_UnitState], block: bool) -> None:
        while True:
            try:
                unit, future = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            active.append(_UnitState(unit, future, iter_rows(unit, self.cfg.storage)))
            block = False

    def _feed(self, active: list[_UnitState]) -> None:
        """Keep a backlog of max_num_seqs queued requests: rows are read only as the engine drains."""
        engine = self.loaded.engine
        for state in active:
            while not state.is_exhausted and engine.num_waiting < self.cfg.engine.max_num_seqs:
                try:
                    item = next(state.rows, None)
                except Exception as e:  # noqa: BLE001 -- storage: this unit fails, the others go on
                    state.failure, item = e, None
                if item is None:
                    state.is_exhausted = True
                else:
                    self._add_row(state, *item)

    def _add_row(self, state: _UnitState, index: int, row: dict) -> None:
        cfg, unit = self.cfg, state.unit
        state.num_rows += 1
        fallback_id = default_id(unit.rel, index)
        try:
            if index in unit.duplicate_rows:
                raise RowError("duplicate_id", cfg.input.id_column,
                               f"id {row.get(cfg.input.id_column)!r} appeared in an earlier row")
            req = row_request(row, index, unit.rel, cfg.input, cfg.sampling, cfg.run.seed, self.loaded.tokenizer)
            self.loaded.engine.add_request(req.id, req.prompt_ids, req.params, req.seed)
        except RowError as e:
            return self._error_row(state, index, row, fallback_id, e.reason, e.field, e.message)
        except RequestError as e:
            return self._error_row(state, index, row, req.id, e.code, e.field, str(e).split(": ", 1)[-1])
        state.pending[req.id] = (index, time.perf_counter())
        state.passthrough[req.id] = passthrough(row, cfg.input)

    def _error_row(self, state, index, row, fallback_id, reason, field_name, message) -> None:
        rid = row.get(self.cfg.input.id_column) if isinstance(row, dict) else None
        state.errors.append({
            "id": str(rid) if rid is not None and reason != "missing_id" else fallback_id,
            "reason": reason, "field": field_name, "message": message, "source_file": state.unit.file,
            "source_row": index, "unit": state.unit.uid, "run_id": self.cfg.run.run_id,
            "config_hash": self.config_hash, **passthrough(row, self.cfg.input)})
        self._stats["rows"] += 1
        self._metrics.on_error_row(reason)

    def _route(self, out, active: list[_UnitState]) -> None:
        owner = {rid: s for s in active for rid in s.pending}
        for r in out.rounds:
            owner[r.request_id].rounds.append({**self._round_row(r, owner[r.request_id].unit.uid),
                                               **owner[r.request_id].passthrough[r.request_id]})
            self._stats["tokens"] += r.emitted
            self._stats["drafted"] += r.draft_len
            self._stats["accepted"] += r.accepted
        for c in out.finished:
            state = owner[c.request_id]
            index, queued = state.pending.pop(c.request_id)
            state.prompt_tokens_reused += c.prompt_tokens_reused
            state.completions.append({**self._completion_row(c, state.unit, index, time.perf_counter() - queued),
                                      **state.passthrough.pop(c.request_id)})
            self._stats["rows"] += 1
        self._stats["steps"] += 1

    def _round_row(self, r: RoundRecord, uid: str) -> dict:
        rejected = [i for i, ok in enumerate(r.accepted_mask) if not ok]
        return {"id": r.request_id, "round": r.round, "draft_len": r.draft_len, "accepted": r.accepted,
                "emitted": r.emitted, "accepted_mask": list(r.accepted_mask),
                "first_rejected": rejected[0] if rejected else None, "batch_size": r.batch_size,
                "draft_s": r.draft_s, "verify_s": r.verify_s, "step": r.step, "worker": self.name, "unit": uid}

    def _completion_row(self, c: Completion, unit: Unit, index: int, latency: float) -> dict:
        n = len(c.output_ids)
        return {"id": c.request_id, "text": c.text, "token_ids": c.output_ids, "finish_reason": c.finish_reason,
                "prompt_tokens": c.prompt_len, "completion_tokens": n, "rounds": c.num_rounds,
                "draft_tokens": c.num_draft_tokens, "accepted_tokens": c.num_accepted,
                "acceptance_rate": c.num_accepted / c.num_draft_tokens if c.num_draft_tokens else None,
                "mean_accepted_length": n / c.num_rounds if c.num_rounds else None, "seed": c.seed,
                "target_model": self.loaded.target_id, "draft_model": self.loaded.draft_id,
                "model_dtype": self.loaded.dtype.dtype,
                "drafter": self.cfg.models.drafter, "config_hash": self.config_hash,
                "run_id": self.cfg.run.run_id, "unit": unit.uid, "source_file": unit.file,
                "source_row": index, "worker": self.name, "latency_s": latency}

    def _commit(self, state: _UnitState) -> None:
        try:
            unit = state.unit
            if state.failure is not None:
                raise RuntimeError(f"unit {unit.uid}: reading {unit.file} failed: "
                                   f"{type(state.failure).__name__}: {state.failure}") from state.failure
            if len(state.completions) + len(state.errors) != unit.num_rows or state.num_rows != unit.num_rows:
                raise RuntimeError(f"unit {unit.uid}: {unit.num_rows} rows planned, {state.num_rows} read, "
                                   f"{len(state.completions)} completions + {len(state.errors)} errors")
            extra = self.cfg.input.passthrough_columns
            tables = {"completions": to_table("completions", state.completions, extra),
                      "rounds": to_table("rounds", state.rounds, extra),
                      "errors": to_table("errors", state.errors, extra)}
            marker = {"rows": unit.num_rows, "completions": len(state.completions), "errors": len(state.errors),
                      "tokens": sum(c["completion_tokens"] for c in state.completions),
                      "draft_tokens": sum(c["draft_tokens"] for c in state.completions),
                      "accepted_tokens": sum(c["accepted_tokens"] for c in state.completions),
                      "prompt_tokens": sum(c["prompt_tokens"] for c in state.completions),
                      "prompt_tokens_reused": state.prompt_tokens_reused,
                      "rounds": len(state.rounds), "worker": self.name,
                      "error_reasons": dict(collections.Counter(e["reason"] for e in state.errors)), "source_file": unit.file,
                      "start": unit.start, "stop": unit.stop, "wall_s": round(time.time() - state.started, 3),
                      "committed_at": time.time()}
            hook = _exit_now if self.cfg.debug.crash_before_commit else None
            committed = self.output.write_unit(unit.uid, tables, marker, before_commit=hook)
            self._metrics.on_commit()                   # flushed before the driver hears of the commit
            state.future.set_result(committed)
            self._stats["units"] += 1
        except BaseException as e:  # noqa: BLE001 -- reported to the driver through the unit's call
            state.future.set_exception(e)

    @property
    def _is_first_w0(self) -> bool:
        return self.index == 0 and self.incarnation == 0

    def _drill_crash_after_steps(self) -> None:
        d, steps = self.cfg.debug, self._stats["steps"]
        if d.crash_worker_after_steps and self._is_first_w0 and steps >= d.crash_worker_after_steps:
            _exit_now()
        if d.hang_worker_after_steps and self._is_first_w0 and steps >= d.hang_worker_after_steps:
            threading.Event().wait()                    # drill: an engine loop that stops (a hang)


def _exit_now() -> None:
    """Failure drill: die like a killed process (no cleanup, no exception)."""
    os._exit(17)
