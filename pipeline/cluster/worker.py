"""The generation worker: a Ray actor holding one engine (target + draft) that turns units into
committed output.

`run_unit(unit)` returns once the unit is committed. The driver keeps `units_in_flight` calls
outstanding per actor; the actor is threaded, so those calls only queue units for one engine loop
thread (engine_loop.py), which reads rows as the engine's backlog drains (feeding.py: the next unit's
rows are admitted while the current one's last sequences still decode, so batches stay full at unit
boundaries). A finished unit is written by a writer thread (commit.py) while the engine keeps
decoding. Failure drills come in as a fault plan (faults.py), whose hooks the worker only calls.

Knows how those parts fit together and the actor's API; knows nothing about planning, retries or
progress bars (the driver's job).
"""
from __future__ import annotations

import functools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..io.reader import Unit
from ..io.writer import RunOutput
from ..job.config import JobConfig, config_hash
from .commit import UnitCommitter
from .engine_loop import EngineLoop, WorkerBroken
from .faults import FaultPlan
from .feeding import RowFeeder
from .metrics import EXPORT_WAIT_MAX_S, WorkerMetrics
from .rank import Rendezvous, ReplicaRanks
from .records import Recorder

__all__ = ["GenerationWorker", "WorkerBroken"]


class GenerationWorker:
    def __init__(self, cfg: JobConfig, name: str, index: int = 0, incarnation: int = 0):
        self.cfg, self.name, self.index, self.incarnation = cfg, name, index, incarnation
        self.config_hash = config_hash(cfg)
        self._faults = FaultPlan.from_config(cfg.debug, index, incarnation)
        self._faults.on_start()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stats = {"rows": 0, "tokens": 0, "drafted": 0, "accepted": 0, "steps": 0, "units": 0,
                       "step_s": 0.0}
        self._metrics = WorkerMetrics(name, cfg.run.run_id, enabled=False)    # a no-op until load()
        self._loop: EngineLoop | None = None
        self._rendezvous: Rendezvous | None = None    # tensor parallel: where the replica's ranks join
        self._tp = None

    def rendezvous(self) -> str:
        """Tensor parallel: the address (this node, a free port) whose store this actor now serves, for
        the replica's other ranks to join."""
        self._rendezvous = ReplicaRanks.for_job(self.cfg).rendezvous()
        return self._rendezvous.address

    # ---- actor methods --------------------------------------------------------------------------
    def ping(self) -> str:
        """Answers as soon as the actor's process is started and constructed (the driver's start check)."""
        return self.name

    def load(self, rendezvous: str | None = None) -> dict:
        """Load models, build the engine and start its loop. Returns model ids and load time. If it
        raises, every later run_unit raises WorkerBroken (no call waits forever). Tensor parallel: called
        with rendezvous()'s result, so Ray starts it once the replica's store is open."""
        try:
            return self._load()
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._ready.set()

    def run_unit(self, unit: Unit) -> dict:
        """Queue a unit and block (this call's thread only) until it is committed; returns its marker."""
        self._ready.wait()
        if self._error is not None:
            raise WorkerBroken(f"worker {self.name} is broken: {type(self._error).__name__}: {self._error}")
        future: Future = Future()
        self._loop.submit(unit, future)
        while True:
            try:
                return future.result(timeout=5)
            except FutureTimeout:
                if self._error is not None:             # the loop died after this unit was queued
                    raise WorkerBroken(f"worker {self.name}: engine loop died: {self._error!r}") from None

    def stats(self) -> dict:
        return {**self._stats, "worker": self.name}

    def export_metrics(self, most_s: float = EXPORT_WAIT_MAX_S) -> float:
        """At a run's end, before the driver ends this actor: the metrics recorded last (a commit flushes
        them into Ray's metric objects) reach the node's exporter, which Ray's core worker reports to
        once per metrics report interval (RAY_metrics_report_interval_ms, 10 s unless set): waits one
        interval (at most `most_s`). Returns the seconds waited (0: metrics off)."""
        if not self._metrics.enabled:
            return 0.0
        self._metrics.flush()
        import ray._raylet
        wait = min(ray._raylet.Config.metrics_report_interval_ms() / 1000 + 0.25, most_s)
        time.sleep(wait)
        return wait

    # ---- loading --------------------------------------------------------------------------------
    @property
    def _threads(self) -> int:
        return max(1, int(self.cfg.cluster.num_cpus_per_worker))

    def _load(self) -> dict:
        import torch

        from ..job.runtime import build_engine
        self._faults.on_load()
        t0 = time.perf_counter()
        # Rows are tokenized between engine steps: the tokenizer's own thread pool would spin on the
        # cores the model's OpenMP threads are using (measured: +50% step time at 2 threads/2 cores).
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        torch.set_num_threads(self._threads)
        self.loaded = build_engine(self.cfg.models, self.cfg.drafting, self.cfg.engine, storage=self.cfg.storage,
                                   tp=self._replica())
        self._metrics = WorkerMetrics(self.name, self.cfg.run.run_id, enabled=self.cfg.run.metrics)
        self._loop = self._engine_loop()
        self._loop.start()
        return self._load_report(time.perf_counter() - t0)

    def _replica(self):
        """Tensor parallel: rank 0's place in this worker's replica, once every rank has joined; None at 1."""
        if self.cfg.models.tensor_parallel_size == 1:
            return None
        if self._rendezvous is None:
            raise RuntimeError("tensor parallel: load() before rendezvous()")
        self._tp = ReplicaRanks.for_job(self.cfg).join(self._rendezvous)
        return self._tp

    def _engine_loop(self) -> EngineLoop:
        """The loop and the parts it drives, around the loaded engine."""
        cfg, stats, metrics = self.cfg, self._stats, self._metrics
        output = RunOutput(cfg.output.path, cfg.run.run_id, cfg.storage, cfg.output.compression)
        committer = UnitCommitter(cfg, self.name, output, self._faults, stats, metrics)
        writer = ThreadPoolExecutor(1, thread_name_prefix="unit-writer")
        return EngineLoop(self.loaded.engine, RowFeeder(cfg, self.config_hash, self.loaded, stats, metrics),
                          Recorder(cfg, self.config_hash, self.name, self.loaded, stats),
                          functools.partial(writer.submit, committer), stats=stats, metrics=metrics,
                          faults=self._faults, num_threads=self._threads, worker=self.name,
                          on_death=self._on_loop_death)

    def _on_loop_death(self, error: BaseException) -> None:
        self._error = error

    def _load_report(self, load_s: float) -> dict:
        loaded = self.loaded
        return {"worker": self.name, "target": loaded.target_id, "draft": loaded.draft_id,
                "dtype": loaded.dtype.dtype, "dtype_reason": loaded.dtype.reason,
                "draft_dtype": loaded.draft_dtype.dtype if loaded.draft_dtype else None,
                "max_num_seqs": loaded.engine.config.max_num_seqs, "slots_reason": loaded.slots_reason,
                "plan": loaded.plan_lines(), "load_s": round(load_s, 2), "pid": os.getpid(),
                "ranks": self._ranks()}

    def _ranks(self) -> list[dict]:
        """Each rank of this worker's replica: device, collective backend, weight bytes held (one entry
        at tensor_parallel_size 1)."""
        backend = self._tp.group.backend if self._tp is not None else None
        return [{"rank": r, "device": self.cfg.models.device, "backend": backend, "weight_bytes": b}
                for r, b in sorted(self.loaded.engine.target.rank_weight_bytes.items())]
