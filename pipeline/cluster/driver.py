"""The driver: plan units, skip committed ones, keep every worker actor busy, supervise them, show
progress, write the manifest last.

Before any actor starts: the output location (not a file, not inside the input), the models (exist,
no pickles), the plan, and the run lease (one live driver per run id). Then units are handed to
ready workers; WorkerPool turns every worker failure into a verdict (see pool.py). A unit that
failed is re-queued unless its marker shows it committed after all; a unit failing
`max_unit_attempts` times fails the job, naming the cause. On SIGINT/SIGTERM dispatch stops,
in-flight units get `shutdown_grace_s` to commit, and the job ends with Interrupted (what was
committed; the same command resumes).

Knows Ray, the plan and the output layout; knows nothing about models or tensors.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import threading
import time

import ray
from tqdm import tqdm

from ..io.lease import LeaseHeld, acquire, owner_info
from ..io.reader import InputError, Unit, check_output_outside_input, plan_units
from ..io.writer import RunOutput
from ..job.config import (
    ClusterConfig,
    JobConfig,
    config_hash,
    hashed_tree,
    redacted,
)
from .faults import FaultPlan
from .pool import LoadFailed, WorkerPool

# Driver wake-ups cost the workers' time on small machines (a woken process preempts a spinning
# OpenMP thread), so progress and stalls are polled at most this often.
PROGRESS_EVERY_S = 2.0
STALL_CHECK_EVERY_S = 10.0
WAIT_S = 1.0                   # the dispatch loop's longest sleep: signals, deadlines, the lease


class JobFailed(RuntimeError):
    pass


class RunBusy(RuntimeError):
    """Another live driver holds this run's lease."""


class Interrupted(RuntimeError):
    def __init__(self, signum: int, committed: int, total: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}: {committed}/{total} units committed")
        self.signum, self.committed, self.total = signum, committed, total


class StopRequest:
    """Set by SIGINT/SIGTERM (or a test): the first stops dispatch and lets in-flight units commit
    for the grace period; a second abandons them at once."""

    def __init__(self):
        self.signum: int | None = None
        self.forced = False

    def request(self, signum: int, frame=None) -> None:
        self.forced = self.signum is not None
        self.signum = self.signum or signum

    def install(self) -> None:
        """Handle SIGINT/SIGTERM (main thread only). Call again after ray.init: Ray installs its own
        SIGTERM handler in the driver."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.request)


def connect(cluster: ClusterConfig, needed_cpus: float) -> bool:
    """Join the configured cluster (or the one `ray job submit` runs us on), else start a local one
    bound to loopback with no dashboard, with token authentication (its token file private to this
    user). True when we called ray.init (and so must shut it down)."""
    if ray.is_initialized():
        return False
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address:
        ray.init(address=address, **quiet)
        return True
    secure_local_token()
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",   # always a new one
             num_cpus=max(os.cpu_count() or 1, int(needed_cpus + 0.999)), **quiet)
    return True


def secure_local_token() -> None:
    """Ray >= 2.52 writes a new local cluster's token to ~/.ray/auth_token with the default umask
    (0644 in a 0755 folder: any local user could take the cluster). Create it ourselves, 0600 in a
    0700 folder, or tighten an existing one, unless a token comes from elsewhere or auth is off."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") \
            or os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return
    import secrets
    folder = os.path.join(os.path.expanduser("~"), ".ray")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    path = os.path.join(folder, "auth_token")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    except FileExistsError:
        os.chmod(path, 0o600)


def run_job(cfg: JobConfig, stop: StopRequest | None = None) -> dict:
    """Run the job to a committed manifest; returns the summary. Raises InputError, OutputError or
    RunBusy before any actor starts; JobFailed or Interrupted after."""
    t_start = time.time()
    stop = stop or StopRequest()
    cfg = dataclasses.replace(cfg, storage=cfg.storage.with_environment())
    out = RunOutput(cfg.output.path, cfg.run.run_id, cfg.storage, cfg.output.compression)
    out.check_location()
    check_output_outside_input(cfg.input, out.url, cfg.storage)
    check_models(cfg)
    units = plan_units(cfg.input, cfg.storage)
    try:
        lease = acquire(out.fs, out.lease_folder, owner_info(run_id=cfg.run.run_id), cfg.run.lease_ttl_s, out.retry)
    except LeaseHeld as e:
        raise RunBusy(f"run {out.url} is being generated by another driver: {e}; wait for it, or run "
                      f"again after its lease expires ({cfg.run.lease_ttl_s:.0f} s without a heartbeat)") from None
    try:
        lease.start_heartbeats()
        return _run_leased(cfg, out, units, lease, stop, t_start)
    finally:
        lease.release()


def _run_leased(cfg, out: RunOutput, units: list[Unit], lease, stop: StopRequest, t_start: float) -> dict:
    chash = config_hash(cfg)
    out.prepare(units, chash, redacted(cfg), hashed_tree(cfg), cfg.run.resume)
    out.roll_forward()
    committed_before = out.committed()
    todo = [u for u in units if u.uid not in committed_before]
    run_stats = {"units": len(units), "units_skipped": len(units) - len(todo), "unit_retries": 0,
                 "worker_restarts": 0, "workers": []}
    if todo:
        started = connect(cfg.cluster, cfg.cluster.num_workers * cfg.cluster.num_cpus_per_worker)
        stop.install()
        try:
            _dispatch(cfg, todo, out, lease, stop, run_stats, len(units) - len(todo))
        finally:
            if started:
                ray.shutdown()
    markers = out.committed()
    fresh = [m for uid, m in markers.items() if uid not in committed_before]
    summary = _summary(cfg, chash, markers, fresh, run_stats, time.time() - t_start, out.url)
    out.finalize(summary)
    return summary


def check_models(cfg: JobConfig) -> None:
    """The target (and draft) exist and hold safetensors/GGUF weights, before any actor starts."""
    from ..loading.files import check_source
    sources = [("models.target", cfg.models.target)]
    if cfg.drafting.uses_draft_model:
        sources.append(("models.draft", cfg.models.draft))
    for key, source in sources:
        try:
            check_source(source)
        except (FileNotFoundError, KeyError) as e:
            raise InputError(f"{key}: {e}") from None


class _Dispatch:
    """One dispatch loop's state: the queue, attempts, counts."""

    def __init__(self, cfg: JobConfig, todo: list[Unit], out: RunOutput, run_stats: dict, committed: int):
        self.cfg, self.out, self.run_stats = cfg, out, run_stats
        self.queue, self.attempts = collections.deque(todo), collections.Counter()
        self.total_units, self.committed_units, self.committed_rows = committed + len(todo), committed, 0

    def account(self, outcome) -> None:
        for unit, marker in outcome.committed:
            self.committed_units += 1
            self.committed_rows += marker["rows"]
        for unit, cause in outcome.failed:
            self.requeue(unit, cause)

    def requeue(self, unit: Unit, cause: str) -> None:
        if self.out.is_committed(unit.uid):         # its marker landed before the call failed
            self.committed_units += 1
            self.committed_rows += unit.num_rows
            return
        self.attempts[unit.uid] += 1
        self.run_stats["unit_retries"] += 1
        if self.attempts[unit.uid] >= self.cfg.cluster.max_unit_attempts:
            raise JobFailed(f"unit {unit.uid} ({unit.file} rows {unit.start}-{unit.stop}) failed "
                            f"{self.attempts[unit.uid]} times; last error: {cause}; {self.status()}")
        self.queue.appendleft(unit)

    def status(self) -> str:
        return f"{self.committed_units}/{self.total_units} units committed"


def _dispatch(cfg: JobConfig, todo: list[Unit], out: RunOutput, lease, stop: StopRequest, run_stats: dict,
              committed: int) -> None:
    pool, d = WorkerPool(cfg), _Dispatch(cfg, todo, out, run_stats, committed)
    faults = FaultPlan.for_driver(cfg.debug)
    pool.start()
    t0 = time.perf_counter()
    t_spawn = pool.clock()
    bar = tqdm(total=sum(u.num_rows for u in todo), unit="row", disable=not cfg.run.progress, smoothing=0.1)
    last_poll, poll_every = 0.0, PROGRESS_EVERY_S if cfg.run.progress else STALL_CHECK_EVERY_S
    grace_until = None
    try:
        while d.queue or pool.in_flight():
            if lease.lost.is_set():
                raise JobFailed(f"the run lease was lost ({lease.lost_reason}); stopped without writing "
                                f"the manifest; {d.status()}")
            if stop.signum is not None:
                grace_until = grace_until or time.monotonic() + cfg.cluster.shutdown_grace_s
                if stop.forced or not pool.in_flight() or time.monotonic() > grace_until:
                    raise Interrupted(stop.signum, d.committed_units, d.total_units)
            elif not faults.holds_dispatch():
                _hand_out(d.queue, pool)
            if not pool.live:
                raise JobFailed(f"no worker left ({pool.restarts} restarts used; {pool.gone_causes()}); "
                                f"{d.status()}, {len(d.queue) + pool.in_flight()} not done")
            ready, _ = ray.wait(pool.pending_refs(), num_returns=1, timeout=WAIT_S)
            for ref in ready:
                d.account(pool.resolve(ref))
            d.account(pool.check_deadlines())
            if time.perf_counter() - last_poll > poll_every:
                last_poll = time.perf_counter()
                stats = pool.poll_stats()
                if cfg.run.progress:
                    _progress(bar, stats, d.committed_rows, t0, len(pool.ready))
        stats = pool.poll_stats(timeout=5.0)
        if cfg.run.progress:
            _progress(bar, stats, d.committed_rows, t0, len(pool.ready))
        if cfg.run.metrics:
            pool.export_metrics()        # the counters of the last commits exported before the actors end
    except LoadFailed as e:
        raise JobFailed(str(e)) from None
    finally:
        pool.kill_all()
        bar.close()
    run_stats["workers"] = pool.loaded
    run_stats["worker_restarts"] = pool.restarts
    run_stats["workers_lost"] = pool.lost()
    first_ready = min(pool.ready_times, default=t_spawn)
    run_stats["workers_ready_s"] = round(max(pool.ready_times[:cfg.cluster.num_workers], default=t_spawn) - t_spawn, 2)
    run_stats["generate_s"] = round(pool.clock() - first_ready, 3)    # first worker ready -> last commit
    final = pool.dead_stats
    run_stats["engine_step_s"] = round(final.get("step_s", 0.0), 3)   # inside engine.step()
    run_stats["engine_steps"] = final.get("steps", 0)


def _hand_out(queue, pool: WorkerPool) -> None:
    """One unit at a time to the ready worker with the fewest queued rows, until every worker holds
    its limit or the queue is empty: small jobs spread over all workers, large ones keep each full.
    The limit is max_units, or a fair share of the units left over the live workers when that is
    smaller: a worker that is ready first must not take every unit of a small job while the others
    are still loading (the demo's 4 units all went to one of its 2 workers)."""
    left = len(queue) + pool.in_flight()
    limit = min(pool.max_units, max(1, -(-left // max(1, len(pool.live)))))
    while queue:
        open_workers = [w for w in pool.ready if len(w.units) < limit]
        if not open_workers:
            return
        w = min(open_workers, key=lambda w: (sum(u.num_rows for u in w.units.values()), w.index))
        pool.submit(w, queue.popleft())


def _progress(bar, stats, committed_rows: int, t0: float, alive: int) -> None:
    bar.n = min(bar.total, max(committed_rows, stats.get("rows", 0)))
    elapsed = max(time.perf_counter() - t0, 1e-9)
    drafted = stats.get("drafted", 0)
    bar.set_postfix(tok_s=f"{stats.get('tokens', 0) / elapsed:.1f}",
                    accept=f"{stats.get('accepted', 0) / drafted:.2f}" if drafted else "-",
                    workers=alive, refresh=False)
    bar.refresh()


MARKER_EXTRAS = ("prompt_tokens", "prompt_tokens_reused",   # marker counts that may be absent (0): prompt positions, those copied,
               "structured", "valid", "forced_tokens")    # rows with a response_format, valid ones, forced tokens


def _summary(cfg, chash, markers: dict, fresh: list[dict], run_stats: dict, wall: float, url: str) -> dict:
    """Totals over every committed unit; rates over the units this invocation ran."""
    keys = ("rows", "completions", "errors", "tokens", "draft_tokens", "accepted_tokens", "rounds")
    total, reasons = collections.Counter(), collections.Counter()
    for m in markers.values():
        total.update({k: m[k] for k in keys})
        total.update({k: m.get(k, 0) for k in MARKER_EXTRAS})      # markers from before they were counted: 0
        reasons.update(m.get("error_reasons", {}))
    new_tokens, new_rows = sum(m["tokens"] for m in fresh), sum(m["rows"] for m in fresh)
    return {"run_id": cfg.run.run_id, "output": url, "config_hash": chash,
            **{k: total[k] for k in keys + MARKER_EXTRAS}, "error_reasons": dict(reasons),
            "prefix_reuse_rate": round(total["prompt_tokens_reused"] / total["prompt_tokens"], 4)
            if total["prompt_tokens"] else None,
            "acceptance_rate": round(total["accepted_tokens"] / total["draft_tokens"], 4)
            if total["draft_tokens"] else None,
            "tokens_per_round": round(total["tokens"] / total["rounds"], 3) if total["rounds"] else None,
            "wall_s": round(wall, 2), "rows_this_run": new_rows, "tokens_this_run": new_tokens,
            "tokens_per_s": round(new_tokens / wall, 1), "rows_per_s": round(new_rows / wall, 2),
            "generate_tokens_per_s": round(new_tokens / run_stats["generate_s"], 1)
            if run_stats.get("generate_s") else None,
            **run_stats}
