"""The worker actors and their supervision.

A worker is STARTING (spawned: its resources reserved on a node, then its process started, then its
models loaded), READY (takes units) or GONE. Its resources are a placement group of one bundle
(STRICT_PACK), so "placed" means Ray reserved them and "started" that the actor's process answers:
a loaded node that starts a process slowly is not taken for a cluster without capacity. Every way
a worker can fail ends in a verdict, never a wait:

    not placed within placement_timeout_s    given up (no capacity): the job goes on without it
    placed, not started within start_timeout_s   given up (the node could not start its process)
    load raised                              the job fails (a model or config problem, same everywhere)
    load not done within load_timeout_s      given up
    actor died (node lost, OOM, os._exit)    its units are re-queued; a replacement is spawned while
                                             restarts are left
    a tensor-parallel rank died              the same, for its whole replica (rank 0 and the other ranks)
    a rank stopped answering                 the same, once it has been silent for collective_timeout_s in
                                             any phase (its load, the join, a step, idle: job/replica.py)
    a rank's load raised                     the job fails, as rank 0's would
    a unit's task raised                     that unit is re-queued (one attempt used); the worker
                                             stays, unless it says it is broken (WorkerBroken)
    no engine step or commit for stall_timeout_s while holding units: killed, as if it died

With models.tensor_parallel_size N a worker is a replica: rank 0 (the GenerationWorker, which runs
the round) and ranks 1..N-1 (RankWorker), one bundle each in one STRICT_PACK group, placed, started and
joined by rank.py's ReplicaRanks (as the processor's replicas are). The other ranks' `serve` calls stay
pending while the replica lives, so a rank's death resolves one of them.

Knows Ray and units; knows nothing about the output layout, models or progress bars.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import remove_placement_group

from ..engine.model.slots import most_max_num_seqs
from ..io.reader import Unit
from ..job.config import JobConfig
from .faults import FaultPlan
from .metrics import EXPORT_WAIT_MAX_S
from .rank import ReplicaRanks
from .worker import GenerationWorker, WorkerBroken

STARTING, READY, GONE = "starting", "ready", "gone"
MAX_UNITS_PER_WORKER = 64     # each queued unit holds one actor thread while it waits


class LoadFailed(RuntimeError):
    """A worker's model load raised: every worker would fail the same way."""


@dataclass
class Worker:
    name: str
    index: int
    incarnation: int
    actor: object
    group: object                                      # its placement group (one bundle)
    placed_ref: object                                 # the group's resources reserved
    started_ref: object                                # the actor's process answers
    load_ref: object
    spawned_at: float
    placed_at: float | None = None
    started_at: float | None = None
    state: str = STARTING
    units: dict = field(default_factory=dict)          # task ref -> unit
    cause: str = ""                                    # why it is gone
    progress: tuple = ()                               # last (steps, units, rows) seen
    progress_at: float = 0.0
    ranks: list = field(default_factory=list)          # tensor parallel: the actors of ranks 1..N-1
    rank_refs: dict = field(default_factory=dict)      # their pending serve() call -> rank


@dataclass
class Outcome:
    """What one finished call meant for the units."""
    committed: list = field(default_factory=list)      # (unit, marker)
    failed: list = field(default_factory=list)         # (unit, cause): re-queue, one attempt used


def cause_of(error: BaseException) -> str:
    """'Type: message' of what really failed, not of Ray's wrapper."""
    if isinstance(error, RayTaskError) and error.cause is not None:
        error = error.cause
    lines = str(error).strip().splitlines()
    text = next((ln for ln in lines if ln.strip()), "")
    return f"{type(error).__name__}: {text}"[:500]


class WorkerPool:
    def __init__(self, cfg: JobConfig, clock=time.monotonic):
        self.cfg, self.clock = cfg, clock
        # units queued per actor: at least units_in_flight, and enough rows that the engine has a
        # full batch running plus a full batch waiting (else slots idle while a unit's last rows
        # finish and its successor travels from the driver)
        rows_wanted = 2 * most_max_num_seqs(cfg.engine.max_num_seqs, cfg.models.device) + cfg.input.rows_per_unit
        self.max_units = min(MAX_UNITS_PER_WORKER, max(cfg.cluster.units_in_flight,
                                                       -(-rows_wanted // cfg.input.rows_per_unit)))
        self.workers: list[Worker] = []
        self.restarts_left = cfg.cluster.max_worker_restarts
        self.restarts = 0
        self.loaded: list[dict] = []                   # load() results, in the order workers became ready
        self.ready_times: list[float] = []             # clock() when each became ready
        self.dead_stats: dict = {}
        self.last_stats: dict[str, dict] = {}

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        for i in range(self.cfg.cluster.num_workers):
            self._spawn(i, 0)

    def _spawn(self, index: int, incarnation: int) -> Worker:
        name = f"w{index}" + (f".{incarnation}" if incarnation else "")
        replica = ReplicaRanks.for_job(self.cfg)
        group = replica.placement_group()
        actor = ray.remote(GenerationWorker).options(max_concurrency=self.max_units + 3,
                                                     **replica.actor_options(group, 0)).remote(
            self.cfg, name, index, incarnation)
        address = actor.rendezvous.remote() if replica.size > 1 else None
        ranks, rank_refs = replica.start(group, address, lambda rank: FaultPlan.for_rank(
            self.cfg.debug, index, incarnation, rank, replica.size))
        w = Worker(name, index, incarnation, actor, group, group.ready(), actor.ping.remote(), actor.load.remote(address),
                   self.clock(), ranks=ranks, rank_refs=rank_refs)
        self.workers.append(w)
        return w

    def retire(self, w: Worker, cause: str, replace: bool) -> list[Unit]:
        """Take a worker out (killing its actor); returns its in-flight units. Spawns a replacement
        when asked and restarts are left."""
        w.state, w.cause = GONE, cause
        units = list(w.units.values())
        w.units.clear()
        stats = self.last_stats.pop(w.name, {})
        for k, v in stats.items():
            if isinstance(v, (int, float)):
                self.dead_stats[k] = self.dead_stats.get(k, 0) + v
        for actor in (w.actor, *w.ranks):
            try:
                ray.kill(actor)
            except RayError:
                pass
        w.rank_refs.clear()
        try:
            remove_placement_group(w.group)
        except (RayError, ValueError):
            pass
        if replace and self.restarts_left > 0:
            self.restarts_left -= 1
            self.restarts += 1
            self._spawn(w.index, w.incarnation + 1)
        return units

    # ---- views ----------------------------------------------------------------------------------
    @property
    def ready(self) -> list[Worker]:
        return [w for w in self.workers if w.state == READY]

    @property
    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.state != GONE]

    def in_flight(self) -> int:
        return sum(len(w.units) for w in self.workers)

    def pending_refs(self) -> list:
        refs = []
        for w in self.live:
            if w.state == STARTING:
                refs.append(w.placed_ref if w.placed_at is None else w.started_ref if w.started_at is None
                            else w.load_ref)
            refs.extend(w.units)
            refs.extend(w.rank_refs)
        return refs

    def lost(self) -> dict[str, str]:
        """Workers lost during the job (not stopped at its end), each with why."""
        return {w.name: w.cause for w in self.workers if w.state == GONE and w.cause != "stopped"}

    def gone_causes(self) -> str:
        return "; ".join(f"{w.name}: {w.cause}" for w in self.workers if w.state == GONE) or "none"

    # ---- events ---------------------------------------------------------------------------------
    def submit(self, w: Worker, unit: Unit) -> None:
        if not w.units:
            w.progress_at = self.clock()               # a stall is measured from the first unit
        w.units[w.actor.run_unit.remote(unit)] = unit

    def resolve(self, ref) -> Outcome:
        """Account for one finished ref (placement, load or unit)."""
        for w in self.live:
            if ref == w.placed_ref:
                return self._on_placed(w)
            if ref == w.started_ref:
                return self._on_started(w)
            if ref == w.load_ref:
                return self._on_loaded(w)
            if ref in w.units:
                return self._on_unit(w, ref)
            if ref in w.rank_refs:
                return self._on_rank_gone(w, ref)
        return Outcome()

    def _on_placed(self, w: Worker) -> Outcome:
        if self._answered(w, w.placed_ref, "could not be placed"):
            w.placed_at = self.clock()
        return Outcome()

    def _on_started(self, w: Worker) -> Outcome:
        if self._answered(w, w.started_ref, "could not start"):
            w.placed_at = w.placed_at or self.clock()
            w.started_at = self.clock()
        return Outcome()

    def _answered(self, w: Worker, ref, failure: str) -> bool:
        """Whether `ref` resolved; where it raised, the worker is retired (and replaced), `failure` named."""
        try:
            ray.get(ref)
            return True
        except RayError as e:
            self.retire(w, f"{failure}: {cause_of(e)}", replace=True)
            return False

    def _on_loaded(self, w: Worker) -> Outcome:
        try:
            self.loaded.append(ray.get(w.load_ref))
            w.state, w.progress_at = READY, self.clock()
            self.ready_times.append(w.progress_at)
        except RayTaskError as e:
            if "RankLost" not in cause_of(e):               # every replica would fail to load alike
                raise LoadFailed(f"worker {w.name} failed to load its models: {cause_of(e)}") from None
            self.retire(w, f"{cause_of(e)}{self._ranks_gone(w)}", replace=True)   # a rank lost, not the load
        except RayError as e:
            self.retire(w, f"died while loading: {cause_of(e)}", replace=True)
        return Outcome()

    def _on_unit(self, w: Worker, ref) -> Outcome:
        unit = w.units.pop(ref)
        try:
            return Outcome(committed=[(unit, ray.get(ref))])
        except RayTaskError as e:
            if not isinstance(e.cause, WorkerBroken):
                return Outcome(failed=[(unit, cause_of(e))])
            cause = cause_of(e)
        except RayActorError as e:
            cause = f"actor died: {cause_of(e)}"
        cause += self._ranks_gone(w)
        others = self.retire(w, cause, replace=True)
        return Outcome(failed=[(u, cause) for u in [unit] + others])

    def _ranks_gone(self, w: Worker, wait_s: float = 2.0) -> str:
        """Tensor parallel: '; rank k died' for each rank of w's replica whose serve() has ended (within
        wait_s: a dead rank's end reaches Ray a moment after rank 0 saw its sockets close)."""
        if not w.rank_refs:
            return ""
        ended, _ = ray.wait(list(w.rank_refs), num_returns=len(w.rank_refs), timeout=wait_s)
        return "".join(f"; rank {w.rank_refs[ref]} died" for ref in ended)

    def _on_rank_gone(self, w: Worker, ref) -> Outcome:
        """A rank's serve() ended while its replica lived: the replica is lost (its units re-queued,
        a replacement spawned), unless loading raised, which every replica would."""
        rank = w.rank_refs.pop(ref)
        try:
            steps = ray.get(ref)
            cause = f"rank {rank} left after {steps} steps"
        except RayTaskError as e:
            if w.state == STARTING and "RankLost" not in cause_of(e):
                raise LoadFailed(f"worker {w.name} rank {rank} failed to load its part of the target: "
                                 f"{cause_of(e)}") from None
            cause = f"rank {rank} failed: {cause_of(e)}"
        except RayActorError as e:
            cause = f"rank {rank} died: {cause_of(e)}"
        units = self.retire(w, f"tensor-parallel {cause}", replace=True)
        return Outcome(failed=[(u, f"tensor-parallel {cause}") for u in units])

    # ---- deadlines --------------------------------------------------------------------------------
    def check_deadlines(self) -> Outcome:
        """Give up on workers past their placement/start/load deadline or stalled while holding units."""
        c, now, out = self.cfg.cluster, self.clock(), Outcome()
        for w in list(self.live):
            if w.state == STARTING and w.placed_at is None and now - w.spawned_at > c.placement_timeout_s:
                ranks = self.cfg.models.tensor_parallel_size
                per = f" on one node for each of {ranks} ranks" if ranks > 1 else ""
                self.retire(w, f"not placed within {c.placement_timeout_s:.0f} s: needs {c.num_cpus_per_worker:g} "
                               f"CPU, {c.num_gpus_per_worker:g} GPU{per}; available now: {_available()}", replace=False)
            elif w.state == STARTING and w.placed_at is not None and w.started_at is None \
                    and now - w.placed_at > c.start_timeout_s:
                self.retire(w, f"placed, but its process did not start within {c.start_timeout_s:.0f} s "
                               "(the node too busy or unable to start workers)", replace=False)
            elif w.state == STARTING and w.started_at is not None and now - w.started_at > c.load_timeout_s:
                self.retire(w, f"model load not done within {c.load_timeout_s:.0f} s", replace=False)
            elif w.state == READY and w.units and now - w.progress_at > c.stall_timeout_s:
                cause = f"no engine step or commit for {c.stall_timeout_s:.0f} s (hung)"
                out.failed += [(u, cause) for u in self.retire(w, cause, replace=True)]
        return out

    def poll_stats(self, timeout: float = 1.0) -> dict:
        """Counters summed over ready workers (now) and gone ones (last seen); notes progress."""
        ready = self.ready
        refs = [w.actor.stats.remote() for w in ready]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for w, ref in zip(ready, refs):
            if ref in done:
                try:
                    self._note(w, ray.get(ref))
                except RayError:
                    pass
        total = dict(self.dead_stats)
        for s in self.last_stats.values():
            for k, v in s.items():
                if isinstance(v, (int, float)):
                    total[k] = total.get(k, 0) + v
        return total

    def _note(self, w: Worker, stats: dict) -> None:
        self.last_stats[w.name] = stats
        progress = (stats.get("steps"), stats.get("units"), stats.get("rows"))
        if progress != w.progress:
            w.progress, w.progress_at = progress, self.clock()

    def export_metrics(self) -> None:
        """A run that ended: every ready worker's last metrics reported before it is ended (at once, so a
        run's end waits one report interval, not one per worker; a worker that does not answer is ended
        all the same)."""
        refs = [w.actor.export_metrics.remote() for w in self.ready]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=EXPORT_WAIT_MAX_S + 5)

    def kill_all(self) -> None:
        for w in self.live:
            self.retire(w, "stopped", replace=False)


def _available() -> dict:
    try:
        return {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
    except (RayError, GetTimeoutError):
        return {}
