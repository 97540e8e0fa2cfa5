"""The driver: plan units, skip committed ones, keep every worker actor busy, survive worker deaths,
show progress, write the manifest last.

Failure handling: a unit whose call fails (its actor died, or the worker raised) goes back to the
queue with its attempt count raised; a dead or broken actor is replaced while the job has restarts
left. The job fails only when a unit has used `max_unit_attempts`, or no worker is left.

Knows Ray, the plan and the output layout; knows nothing about models or tensors.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from tqdm import tqdm

from ..config import ClusterConfig, JobConfig, config_hash, redacted
from ..io.reader import Unit, plan_units
from ..io.writer import RunOutput
from .worker import GenerationWorker


# Driver wake-ups cost the workers' time on small machines (a woken process preempts a spinning
# OpenMP thread), so progress is polled at most this often, and not at all with run.progress=false.
PROGRESS_EVERY_S = 2.0
MAX_UNITS_PER_WORKER = 64     # each queued unit holds one actor thread while it waits


class JobFailed(RuntimeError):
    pass


def connect(cluster: ClusterConfig, needed_cpus: float) -> bool:
    """Join the configured cluster (or the one `ray job submit` runs us on), else start a local one
    bound to loopback with no dashboard; Ray >= 2.52 turns token authentication on for it unless
    RAY_AUTH_MODE says otherwise. True when we called ray.init (and so must shut it down)."""
    if ray.is_initialized():
        return False
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address:
        ray.init(address=address, **quiet)
        return True
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",   # always a new one
             num_cpus=max(os.cpu_count() or 1, int(needed_cpus + 0.999)), **quiet)
    return True


@dataclass
class _Worker:
    name: str
    index: int
    incarnation: int
    actor: object
    units: dict = field(default_factory=dict)         # ref -> unit
    is_alive: bool = True


class WorkerPool:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        # units queued per actor: at least units_in_flight, and enough rows that the engine has a
        # full batch running plus a full batch waiting (else slots idle while a unit's last rows
        # finish and its successor travels from the driver)
        rows_wanted = 2 * cfg.engine.max_num_seqs + cfg.input.rows_per_unit
        self.max_units = min(MAX_UNITS_PER_WORKER, max(cfg.cluster.units_in_flight,
                                                       -(-rows_wanted // cfg.input.rows_per_unit)))
        self.workers: list[_Worker] = []
        self.restarts_left = cfg.cluster.max_worker_restarts
        self.dead_stats: dict = collections.Counter()
        self.last_stats: dict[str, dict] = {}

    def _spawn(self, index: int, incarnation: int) -> _Worker:
        c = self.cfg.cluster
        name = f"w{index}" + (f".{incarnation}" if incarnation else "")
        actor = ray.remote(GenerationWorker).options(
            num_cpus=c.num_cpus_per_worker, num_gpus=c.num_gpus_per_worker, max_restarts=0,
            max_concurrency=self.max_units + 2).remote(self.cfg, name, index, incarnation)
        return _Worker(name, index, incarnation, actor)

    def start(self) -> list[dict]:
        """Create every actor and wait for its models: a load error fails the job before any unit."""
        self.workers = [self._spawn(i, 0) for i in range(self.cfg.cluster.num_workers)]
        refs = [w.actor.load.remote() for w in self.workers]
        timeout = 900
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            c = self.cfg.cluster
            raise JobFailed(f"workers not ready after {timeout} s: each needs {c.num_cpus_per_worker} CPUs and "
                            f"{c.num_gpus_per_worker} GPUs; the cluster has {ray.cluster_resources()}") from None
        except RayError as e:
            raise JobFailed(f"a worker failed to load its models: {e}") from None

    def replace(self, dead: _Worker) -> _Worker | None:
        dead.is_alive = False
        stats = self.last_stats.pop(dead.name, {})
        self.dead_stats.update({k: v for k, v in stats.items() if isinstance(v, (int, float))})
        try:
            ray.kill(dead.actor)
        except RayError:
            pass
        if self.restarts_left <= 0:
            return None
        self.restarts_left -= 1
        new = self._spawn(dead.index, dead.incarnation + 1)
        new.actor.load.remote()                       # run_unit waits for it inside the actor
        self.workers.append(new)
        return new

    @property
    def alive(self) -> list[_Worker]:
        return [w for w in self.workers if w.is_alive]

    def poll_stats(self) -> dict:
        """Counters summed over live workers (now) and dead ones (last seen)."""
        alive = self.alive
        refs = [w.actor.stats.remote() for w in alive]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
        for w, ref in zip(alive, refs):
            if ref in ready:
                try:
                    self.last_stats[w.name] = ray.get(ref)
                except RayError:
                    pass
        total = collections.Counter(self.dead_stats)
        for s in self.last_stats.values():
            total.update({k: v for k, v in s.items() if isinstance(v, (int, float))})
        return total


def run_job(cfg: JobConfig) -> dict:
    """Run the job to a committed manifest; returns the summary. Raises JobFailed, InputError,
    OutputError with a clear message otherwise."""
    t_start = time.time()
    cfg = dataclasses.replace(cfg, storage=cfg.storage.with_environment())
    units = plan_units(cfg.input, cfg.storage)
    chash = config_hash(cfg)
    out = RunOutput(cfg.output.path, cfg.run.run_id, cfg.storage, cfg.output.compression)
    out.prepare(units, chash, redacted(cfg), cfg.run.resume)
    out.roll_forward()
    committed_before = out.committed()
    todo = [u for u in units if u.uid not in committed_before]
    run_stats = {"units": len(units), "units_skipped": len(units) - len(todo), "unit_retries": 0,
                 "worker_restarts": 0, "workers": []}
    if todo:
        started = connect(cfg.cluster, cfg.cluster.num_workers * cfg.cluster.num_cpus_per_worker)
        try:
            _dispatch(cfg, todo, run_stats)
        finally:
            if started:
                ray.shutdown()
    markers = out.committed()
    fresh = [m for uid, m in markers.items() if uid not in committed_before]
    summary = _summary(cfg, chash, markers, fresh, run_stats, time.time() - t_start, out.url)
    out.finalize(summary)
    return summary


def _dispatch(cfg: JobConfig, todo: list[Unit], run_stats: dict) -> None:
    pool = WorkerPool(cfg)
    t_spawn = time.perf_counter()
    run_stats["workers"] = pool.start()
    run_stats["workers_ready_s"] = round(time.perf_counter() - t_spawn, 2)
    t_first = time.perf_counter()
    queue, attempts = collections.deque(todo), collections.Counter()
    rows_total = sum(u.num_rows for u in todo)
    bar = tqdm(total=rows_total, unit="row", disable=not cfg.run.progress, smoothing=0.1)
    committed_rows, t0, last_poll = 0, time.perf_counter(), 0.0
    while queue or any(w.units for w in pool.workers):
        _hand_out(queue, pool)
        refs = {ref: w for w in pool.workers for ref in w.units}
        if not refs:
            raise JobFailed(f"no worker left ({run_stats['worker_restarts']} restarts used); "
                            f"{len(queue)} units not done")
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=PROGRESS_EVERY_S if cfg.run.progress else None)
        for ref in ready:
            w = refs[ref]
            if ref not in w.units:                      # already re-queued with its dead worker
                continue
            unit = w.units.pop(ref)
            try:
                committed_rows += ray.get(ref)["rows"]
                continue
            except (RayActorError, RayTaskError) as e:
                failed = [unit] + list(w.units.values())  # the worker's other units go back too
                w.units.clear()
                _requeue(cfg, failed, queue, attempts, run_stats, e)
                if pool.replace(w) is not None:
                    run_stats["worker_restarts"] += 1
        if cfg.run.progress and time.perf_counter() - last_poll > PROGRESS_EVERY_S:
            last_poll = time.perf_counter()
            _progress(bar, pool.poll_stats(), committed_rows, t0, len(pool.alive))
    run_stats["generate_s"] = round(time.perf_counter() - t_first, 3)   # first unit handed out -> last commit
    final = pool.poll_stats()
    run_stats["engine_step_s"] = round(final.get("step_s", 0.0), 3)   # inside engine.step()
    run_stats["engine_steps"] = final.get("steps", 0)
    if cfg.run.progress:
        _progress(bar, pool.poll_stats(), committed_rows, t0, len(pool.alive))
    bar.close()


def _hand_out(queue, pool: WorkerPool) -> None:
    """One unit at a time to the live worker with the fewest queued rows, until every worker holds
    max_units or the queue is empty: small jobs spread over all workers, large ones keep each full."""
    while queue:
        open_workers = [w for w in pool.alive if len(w.units) < pool.max_units]
        if not open_workers:
            return
        w = min(open_workers, key=lambda w: (sum(u.num_rows for u in w.units.values()), w.index))
        unit = queue.popleft()
        w.units[w.actor.run_unit.remote(unit)] = unit


def _requeue(cfg, failed: list[Unit], queue, attempts, run_stats, error) -> None:
    for unit in failed:
        attempts[unit.uid] += 1
        run_stats["unit_retries"] += 1
        if attempts[unit.uid] >= cfg.cluster.max_unit_attempts:
            raise JobFailed(f"unit {unit.uid} ({unit.file} rows {unit.start}-{unit.stop}) failed "
                            f"{attempts[unit.uid]} times; last error: {_short(error)}")
        queue.appendleft(unit)


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__


def _progress(bar, stats, committed_rows: int, t0: float, alive: int) -> None:
    bar.n = min(bar.total, max(committed_rows, stats.get("rows", 0)))
    elapsed = max(time.perf_counter() - t0, 1e-9)
    drafted = stats.get("drafted", 0)
    bar.set_postfix(tok_s=f"{stats.get('tokens', 0) / elapsed:.1f}",
                    accept=f"{stats.get('accepted', 0) / drafted:.2f}" if drafted else "-",
                    workers=alive, refresh=False)
    bar.refresh()


def _summary(cfg, chash, markers: dict, fresh: list[dict], run_stats: dict, wall: float, url: str) -> dict:
    """Totals over every committed unit; rates over the units this invocation ran."""
    keys = ("rows", "completions", "errors", "tokens", "draft_tokens", "accepted_tokens", "rounds")
    total, reasons = collections.Counter(), collections.Counter()
    for m in markers.values():
        total.update({k: m[k] for k in keys})
        reasons.update(m.get("error_reasons", {}))
    new_tokens, new_rows = sum(m["tokens"] for m in fresh), sum(m["rows"] for m in fresh)
    return {"run_id": cfg.run.run_id, "output": url, "config_hash": chash,
            **{k: total[k] for k in keys}, "error_reasons": dict(reasons),
            "acceptance_rate": round(total["accepted_tokens"] / total["draft_tokens"], 4)
            if total["draft_tokens"] else None,
            "tokens_per_round": round(total["tokens"] / total["rounds"], 3) if total["rounds"] else None,
            "wall_s": round(wall, 2), "rows_this_run": new_rows, "tokens_this_run": new_tokens,
            "tokens_per_s": round(new_tokens / wall, 1), "rows_per_s": round(new_rows / wall, 2),
            "generate_tokens_per_s": round(new_tokens / run_stats["generate_s"], 1)
            if run_stats.get("generate_s") else None,
            **run_stats}
