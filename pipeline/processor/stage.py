"""The processor's stage: a Ray Data actor holding one engine that stays full across batches.

`SpecpipeStage` is the class `map_batches` runs on an actor pool. Its `__call__` is a coroutine:
Ray Data hands one replica several batches at once (`batches_per_replica`), each call queues its
rows on the replica's one engine (`EngineThread`, which steps it continuously) and awaits them, so
the next batch's rows join the running batch as the earlier rows finish: the engine's batch never
drains to zero at a batch boundary. A bad row is answered at once (rows.py) and never reaches the
engine; one that the engine refuses (a prompt too long, a response_format that does not compile)
is answered with the engine's reason.

Rounds log (`rounds_path`): each call writes its rows' completions, rounds and errors as one unit of a
run folder, through the job's writer (stage -> marker -> publish), so `python -m pipeline.report`
and the acceptance notebook read a processor run as they read a job's.

Knows Ray Data's actor-UDF shape (an async __call__ over Arrow batches), the engine's step API and the
writer; the row shape is rows.py's, its validation job/rows.py's.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import json
import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable

import pyarrow as pa

from ..cluster.rank import ReplicaRanks
from ..cluster.records import completion_row, round_row
from ..engine.core.request import RequestError
from ..io.schema import to_table
from ..io.writer import RunOutput
from ..job.config import ENGINE_NOT_HASHED
from ..job.rows import RowError, RowRequest, row_request
from .config import SpecpipeProcessorConfig
from .rows import error_row, output_row, processor_columns, row_error, with_output

if TYPE_CHECKING:
    from ..engine import Completion, StepOutput

log = logging.getLogger(__name__)
STATS_EVERY_S = 30.0          # how often a replica logs its tokens/s and acceptance


class Refused(Exception):
    """A row the engine thread did not queue: its RowError (validation, tokenization) or the engine's
    RequestError, with its request id where it had one."""

    def __init__(self, error: RowError | RequestError, request_id: str | None):
        super().__init__(str(error))
        self.error, self.request_id = error, request_id


class EngineThread:
    """Steps one engine on its own thread. `submit` (any thread) queues a row's `prepare` (validation and
    tokenization, as the job's engine loop does between steps, so that they never compete with a step
    for its cores) and returns a future of its Completion (or Refused). Only this thread touches the
    engine and names requests (a row's key, or a numbered copy while that key is in flight). If a step
    raises, the thread stops and every pending and later request fails with it, then `on_error(e)` runs.
    `on_idle` runs (on this thread) each time the engine drains: it has stepped since the last drain,
    runs nothing and has nothing queued (the end of a dataset, or a stall in its input)."""

    def __init__(self, engine, num_threads: int, on_step=None, on_idle=None, on_error=None):
        self.engine, self.num_threads, self.on_step, self.on_idle = engine, num_threads, on_step, on_idle
        self.on_error = on_error
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[str, Future] = {}
        self._copies = itertools.count()
        self.error: BaseException | None = None
        self.stats = {"rows": 0, "tokens": 0, "drafted": 0, "accepted": 0, "steps": 0, "step_s": 0.0}
        threading.Thread(target=self._run, name="specpipe-engine", daemon=True).start()

    def submit(self, prepare: Callable[[], RowRequest]) -> Future:
        future: Future = Future()
        if self.error is not None:
            future.set_exception(RuntimeError(f"the engine stopped: {self.error!r}"))
        else:
            self._inbox.put((prepare, future))
        return future

    def _run(self) -> None:
        import torch
        torch.set_num_threads(self.num_threads)       # OpenMP thread counts are per thread
        busy = False
        try:
            while True:
                if busy and not self.engine.has_unfinished() and self._inbox.empty():
                    busy = False
                    if self.on_idle is not None:
                        self.on_idle()
                self._admit(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    busy = True
                    self._step()
        except BaseException as e:  # noqa: BLE001 -- every waiting row must hear about it
            self.error = e
            log.exception("engine thread stopped")
            for future in self._pending.values():
                future.set_exception(RuntimeError(f"the engine stopped: {e!r}"))
            while not self._inbox.empty():
                self._inbox.get()[1].set_exception(RuntimeError(f"the engine stopped: {e!r}"))
            if self.on_error is not None:
                self.on_error(e)

    def _admit(self, block: bool) -> None:
        while True:
            try:
                prepare, future = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            try:
                row = prepare()
            except RowError as e:
                future.set_exception(Refused(e, None))
                continue
            rid = row.id
            while rid in self._pending:
                rid = f"{row.id}#{next(self._copies)}"
            try:
                self.engine.add_request(rid, row.prompt_ids, row.params, row.seed)
            except RequestError as e:
                future.set_exception(Refused(e, rid))
                continue
            self._pending[rid] = future

    def _step(self) -> None:
        t0 = time.perf_counter()
        out: StepOutput = self.engine.step()
        s = self.stats
        s["step_s"] += time.perf_counter() - t0
        s["steps"] += 1
        for r in out.rounds:
            s["tokens"] += r.emitted
            s["drafted"] += r.draft_len
            s["accepted"] += r.accepted
        if self.on_step is not None:
            self.on_step(out)
        for c in out.finished:
            s["rows"] += 1
            self._pending.pop(c.request_id).set_result(c)


class SpecpipeStage:
    """The map_batches UDF: one engine per replica, rows in and out as Arrow batches."""

    def __init__(self, config: SpecpipeProcessorConfig):
        import torch

        from ..job.runtime import build_engine
        self.config = config
        self._columns = processor_columns(config.id_column)
        _show_progress()
        os.environ["TOKENIZERS_PARALLELISM"] = "false"   # tokenizing between steps; its pool would spin
        torch.set_num_threads(config.threads)
        t0 = time.perf_counter()
        self.name = f"replica-{uuid.uuid4().hex[:8]}"
        try:
            self.tp = self._ranks() if config.models.tensor_parallel_size > 1 else None
            self.loaded = build_engine(config.models, config.drafting, config.engine, storage=config.storage,
                                       tp=self.tp)
        except BaseException as e:
            self._lost_rank(e)
            raise
        self._rounds: dict[str, list[dict]] = {}        # request id -> its round rows (rounds log only)
        self._engine = EngineThread(self.loaded.engine, config.threads,
                                    self._keep_rounds if config.rounds_path else None, self._log_stats,
                                    self._lost_rank)
        self._output = (RunOutput(config.rounds_path, config.run_id, config.storage)
                        if config.rounds_path else None)
        self._stamp = {"target_model": self.loaded.target_id, "draft_model": self.loaded.draft_id,
                       "model_dtype": self.loaded.dtype.dtype, "drafter": config.drafting.method,
                       "config_hash": config_digest(config), "run_id": config.run_id}
        self._t0, self._last_log = time.perf_counter(), time.perf_counter()
        log.info("%s loaded in %.1f s: %s; max_num_seqs %d%s%s", self.name, time.perf_counter() - t0,
                 "; ".join(self.loaded.plan_lines()), self.loaded.engine.config.max_num_seqs,
                 f" ({self.loaded.slots_reason})" if self.loaded.slots_reason else "", self._ranks_line())

    def _ranks(self):
        """Tensor parallel: ranks 1..N-1 started in this replica's placement group (bundles 1..N-1;
        build_processor reserves it), rank 0's place once all have joined. A rank that dies or stops
        answering ends this replica's process, which Ray Data restarts, as it does a replica lost any
        other way."""
        import ray
        group = ray.util.get_current_placement_group()
        if group is None:
            raise RuntimeError("models.tensor_parallel_size > 1: the replica must run in its placement group "
                               "(build_processor reserves one per replica)")
        replica = replica_ranks(self.config)
        rendezvous = replica.rendezvous()
        self._rank_actors, self._rank_refs = replica.start(group, rendezvous.address)
        threading.Thread(target=self._watch_ranks, name="specpipe-ranks", daemon=True).start()
        return replica.join(rendezvous)

    def _watch_ranks(self) -> None:
        """A rank's serve() ending while this replica lives means the rank is gone: this process ends
        too (its rows are retried on the restarted replica)."""
        import ray
        done, _ = ray.wait(list(self._rank_refs), num_returns=1, timeout=None)
        try:
            ray.get(done[0])
            why = "left"
        except Exception as e:  # noqa: BLE001 -- any end of a rank ends the replica
            why = f"died: {type(e).__name__}"
        log.error("%s: tensor-parallel rank %d %s; the replica ends", self.name, self._rank_refs[done[0]], why)
        os._exit(1)

    def _lost_rank(self, e: BaseException) -> None:
        """A rank lost while loading or stepping (died, or stopped answering: RankLost) ends this process,
        as a rank's death does (_watch_ranks); other errors are the caller's."""
        from ..engine.parallel.group import RankLost
        if isinstance(e, RankLost):
            log.error("%s: %s; the replica ends", self.name, e)
            os._exit(1)

    def _ranks_line(self) -> str:
        if self.tp is None:
            return ""
        held = ", ".join(f"rank {r} holds {b / 2**20:.1f} MiB"
                         for r, b in sorted(self.loaded.engine.target.rank_weight_bytes.items()))
        return (f"; {self.tp.size} ranks on {self.config.models.device} over {self.tp.group.backend} "
                f"(weights: {held})")

    async def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        out: list[dict | None] = [None] * len(rows)
        cfg, tokenizer = self.config, self.loaded.tokenizer
        waiting = [asyncio.wrap_future(self._engine.submit(functools.partial(
            row_request, row, self._columns, cfg.sampling, cfg.seed, tokenizer))) for row in rows]
        done: list[tuple[Completion, float]] = []
        errors: list[dict] = []
        t0 = time.perf_counter()
        for i, future in enumerate(waiting):
            try:
                c = await future
            except Refused as e:
                out[i] = self._refused(e.error, errors, rows[i], e.request_id)
            else:
                out[i] = output_row(c)
                done.append((c, time.perf_counter() - t0))
        if self._output is not None:
            self._log_unit(done, errors)
        self._maybe_log_stats()
        return with_output(batch, out)

    def _refused(self, e: RowError | RequestError, errors: list[dict], row: dict, rid: str | None = None) -> dict:
        if not self.config.should_continue_on_error:
            raise ValueError(f"bad row ({e}); should_continue_on_error=False") from None
        e = row_error(e)
        key = rid or (str(row.get(self.config.id_column)) if self.config.id_column else None)
        errors.append({"id": key, "reason": e.reason, "field": e.field, "message": e.message,
                       "source_file": None, "source_row": None, "unit": None, "run_id": self.config.run_id,
                       "config_hash": self._stamp["config_hash"]})
        return error_row(e)

    # ---- the rounds log ------------------------------------------------------------------------
    def _keep_rounds(self, out: StepOutput) -> None:            # on the engine thread
        for r in out.rounds:
            self._rounds.setdefault(r.request_id, []).append(round_row(r, self.name, ""))

    def _log_unit(self, done: list[tuple[Completion, float]], errors: list[dict]) -> None:
        uid = f"{self.name}-{uuid.uuid4().hex[:12]}"
        completions = [completion_row(c, self._stamp, self.name, uid, None, None, latency) for c, latency in done]
        rounds = [{**r, "unit": uid} for c, _ in done for r in self._rounds.pop(c.request_id, [])]
        for e in errors:
            e["unit"] = uid
        tables = {"completions": to_table("completions", completions), "rounds": to_table("rounds", rounds),
                  "errors": to_table("errors", errors)}
        self._output.write_unit(uid, tables, {"rows": len(done) + len(errors), "worker": self.name})

    def _maybe_log_stats(self) -> None:
        if time.perf_counter() - self._last_log >= STATS_EVERY_S:
            self._log_stats()

    def _log_stats(self) -> None:
        """The replica's totals since it loaded (every STATS_EVERY_S and whenever its engine drains)."""
        now = self._last_log = time.perf_counter()
        s = self._engine.stats
        drafts = f"acceptance {s['accepted'] / s['drafted']:.2f}" if s["drafted"] else "nothing drafted"
        log.info("%s: %d rows, %d tokens, %.1f tokens/s, %s, %d steps taking %.1f of %.1f s",
                 self.name, s["rows"], s["tokens"], s["tokens"] / max(now - self._t0, 1e-9), drafts, s["steps"],
                 s["step_s"], now - self._t0)


def _show_progress() -> None:
    """The replica's load line and its tokens/s and acceptance (every STATS_EVERY_S and when its engine
    drains) on its stderr, which Ray forwards to the driver under the actor's name (a worker's own
    logging shows WARNING and up)."""
    pkg = logging.getLogger("pipeline.processor")
    if not pkg.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        pkg.addHandler(handler)
        pkg.setLevel(logging.INFO)
        pkg.propagate = False


def replica_ranks(config: SpecpipeProcessorConfig) -> ReplicaRanks:
    """How a replica's ranks are placed, started and joined (cluster/rank.py, as in the job)."""
    return ReplicaRanks(config.models, config.storage, config.num_cpus, config.num_gpus, config.startup_timeout_s,
                        config.collective_timeout_s)


def config_digest(config: SpecpipeProcessorConfig) -> str:
    """Short hash of what determines the output: the engine sections and the seeding (the engine keys
    the job's hash leaves out, left out here too)."""
    tree = config.tree()
    kept = {k: tree[k] for k in ("models", "drafting", "sampling", "id_column", "seed")}
    kept["engine"] = {k: v for k, v in tree["engine"].items() if k not in ENGINE_NOT_HASHED}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]
