"""Failure drills on real components: the job as users run it (`python jobs/generate.py ...` as a
subprocess against a real `ray start --head`), faults as they happen (a lost Ray node, an S3 server
failing requests, a full disk, signals, a second driver), and the invariant everywhere: either exit 0
with every input row id exactly once in completions + errors, or a non-zero exit within a bounded
time naming the cause, after which a rerun completes exactly once with no manual repair."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RayHead
from faults import RayNode, S3FaultProxy, _cmdline, fill_until_full, small_disk, wait_for_nodes
from pipeline.cluster.driver import JobFailed, run_job
from pipeline.engine.backends.cpu.build import cache_dir as kernel_cache_dir
from pipeline.io.reader import InputError
from pipeline.io.writer import OutputError
from pipeline.loading.files import cache_root
from pipeline_util import job_config, job_overrides, prompt_rows, read_run, write_parquet
from pipeline_util import check_exactly_once, shards
from s3_util import moto_endpoint, s3  # noqa: F401 -- fixtures

VERDICT_S = 120          # a fault must end in a verdict this fast: well under 2 minutes


class Job:
    """jobs/generate.py in a subprocess, output captured."""

    def __init__(self, tmp_path: Path, overrides: list[str], env: dict | None = None, name: str = "job"):
        self.log = tmp_path / f"{name}.log"
        self.proc = subprocess.Popen([sys.executable, "jobs/generate.py", *overrides], env=env or os.environ.copy(),
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout=timeout)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _wait_for_markers(run_dir: Path, n: int, job: Job, timeout: float = 240) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline and job.proc.poll() is None:
        found = len(list((run_dir / "_committed").glob("*.json")))
        if found >= n:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{n} units not committed while the job ran (exit {job.proc.poll()}):\n{job.output[-3000:]}")


def _overrides(model_dir, tmp_path, address, *extra, out="out"):
    return job_overrides(model_dir, str(tmp_path / "in"), str(tmp_path / out), f"cluster.address={address}",
                         "input.rows_per_unit=2", "sampling.max_tokens=24", *extra)


# ---- a lost node ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_head():
    """A head with no CPUs: every worker lands on a node a test can lose. Ray's default health checks (a lost node is declared dead after ~15 s): the
    shorter ones of faults.FAST_NODE_FAILURE_ENV declared live nodes dead on this loaded 2-core box."""
    head = RayHead(num_cpus=0)
    yield head
    head.stop()


def _worker_nodes(head) -> set[str]:
    from ray.util.state import list_actors
    actors = list_actors(address=head.dashboard_url, filters=[("class_name", "=", "GenerationWorker"),
                                                               ("state", "=", "ALIVE")], timeout=30)
    return {a.node_id for a in actors}


@pytest.mark.slow
@pytest.mark.parametrize("spare", [False, True], ids=["no-spare-capacity", "spare-capacity"])
def test_lost_node(spare, small_head, tiny_model_dir, tmp_path):
    """Two 1-CPU nodes; a node holding a worker is lost mid-run (SIGKILL of its raylet).
    No spare capacity: two workers, one per node; the replacement cannot be placed, so after
    placement_timeout_s the job goes on with the live worker and finishes (before: stuck at 15/20
    units for 300 s, no message). Spare capacity: one worker; its replacement is placed on the other
    node and must finish the job."""
    ids = shards(tmp_path / "in", files=2, rows=40)          # ~20 s of work: the loss comes early
    nodes = [RayNode(small_head, num_cpus=1) for _ in range(2)]
    workers = 1 if spare else 2
    try:
        job = Job(tmp_path, _overrides(tiny_model_dir, tmp_path, small_head.address, "cluster.placement_timeout_s=30",
                                       "sampling.max_tokens=128", f"cluster.num_workers={workers}"))
        markers, deadline = tmp_path / "out" / "t" / "_committed", time.time() + 180
        while len({json.loads(m.read_text())["worker"] for m in markers.glob("*.json")}) < workers:
            assert time.time() < deadline and job.proc.poll() is None, f"both workers never committed:\n{job.output[-2000:]}"
            time.sleep(0.2)
        hosts = _worker_nodes(small_head)                     # both workers are working: lose one's node
        lost = next(n for n in nodes if n.node_id in hosts)
        lost.kill()
        killed = time.time()
        rc = job.wait(timeout=VERDICT_S + 120)
        assert rc == 0, job.output[-3000:]
        assert time.time() - killed < VERDICT_S + 60
        print(f"lost node (spare={spare}): exit {rc} {time.time() - killed:.1f} s after the kill")
        wait_for_nodes(small_head, dead_ids=[lost.node_id], timeout=30)
    finally:
        for n in nodes:
            n.stop()
    run = read_run(tmp_path / "out" / "t")
    check_exactly_once(run, ids)
    by = {c["worker"] for c in run["completions"]}
    assert by == ({"w0", "w0.1"} if spare else {"w0", "w1"}), by
    summary = json.loads((tmp_path / "out" / "t" / "manifest.json").read_text())
    assert summary["worker_restarts"] >= 1 and summary["unit_retries"] >= 1, job.output[-3000:]


# ---- supervision deadlines (in-process, shared head) ------------------------------------------------
@pytest.mark.slow
def test_hung_worker_is_replaced(tiny_model_dir, ray_head, tmp_path):
    ids = shards(tmp_path / "in", files=1, rows=8)
    cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"), f"cluster.address={ray_head.address}",
                     "cluster.num_workers=1", "debug.hang_worker_after_steps=3", "cluster.stall_timeout_s=8")
    summary = run_job(cfg)
    assert summary["worker_restarts"] == 1 and summary["unit_retries"] >= 1
    run = read_run(tmp_path / "out" / "t")
    check_exactly_once(run, ids)
    assert {c["worker"] for c in run["completions"]} == {"w0.1"}


@pytest.mark.slow
def test_hung_load_and_unplaceable_worker_end_in_a_named_verdict(tiny_model_dir, ray_head, tmp_path):
    shards(tmp_path / "in", files=1, rows=4)
    base = (tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"), f"cluster.address={ray_head.address}",
            "cluster.num_workers=1")
    t0 = time.time()
    with pytest.raises(JobFailed, match=r"no worker left .*w0: model load not done within 5 s.*0/1 units committed"):
        run_job(job_config(*base, "debug.hang_load=true", "cluster.load_timeout_s=5", "run.run_id=hang"))
    with pytest.raises(JobFailed, match=r"w0: not placed within 5 s: needs 64 CPU, 0 GPU; available now"):
        run_job(job_config(*base, "cluster.num_cpus_per_worker=64", "cluster.placement_timeout_s=5", "run.run_id=big"))
    with pytest.raises(JobFailed, match=r"w0: placed, but its process did not start within 2 s"):
        run_job(job_config(*base, "debug.start_delay_s=30", "cluster.start_timeout_s=2", "run.run_id=slow"))
    assert time.time() - t0 < 90


@pytest.mark.slow
def test_a_worker_slow_to_start_is_not_taken_for_missing_capacity(tiny_model_dir, ray_head, tmp_path):
    """Its resources are reserved at once, its process answers only after 8 s (a loaded node): with
    a placement timeout of 2 s the job still runs on it, since placement and start are separate."""
    ids = shards(tmp_path / "in", files=1, rows=4)
    cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"), f"cluster.address={ray_head.address}",
                     "cluster.num_workers=1", "debug.start_delay_s=8", "cluster.placement_timeout_s=2")
    summary = run_job(cfg)
    assert summary["worker_restarts"] == 0
    check_exactly_once(read_run(tmp_path / "out" / "t"), ids)


# ---- S3 faults --------------------------------------------------------------------------------------
@pytest.fixture
def s3_faulty(s3, moto_endpoint):
    with S3FaultProxy(moto_endpoint, seed=7) as proxy:
        yield s3, proxy


def _s3_overrides(model_dir, address, proxy_url, *extra):
    from s3_util import BUCKET, KEY, REGION, SECRET
    return job_overrides(model_dir, f"s3://{BUCKET}/in", f"s3://{BUCKET}/out", f"cluster.address={address}",
                         "input.rows_per_unit=2", "sampling.max_tokens=16", f"storage.endpoint_url={proxy_url}",
                         f"storage.key={KEY}", f"storage.secret={SECRET}", f"storage.region={REGION}",
                         "storage.retry_backoff_s=0.2", *extra)


def _s3_shards(fs, n=12) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from s3_util import BUCKET
    rows = prompt_rows(n, "s")
    with fs.open(f"{BUCKET}/in/a.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pylist(rows), f, row_group_size=4)
    return [r["id"] for r in rows]


def _s3_ids(fs) -> list[str]:
    import pyarrow.parquet as pq
    from s3_util import BUCKET
    got = []
    for kind in ("completions", "errors"):
        for path in fs.glob(f"{BUCKET}/out/t/{kind}/*.parquet"):
            with fs.open(path, "rb") as f:
                got += pq.read_table(f, columns=["id"]).column("id").to_pylist()
    return got


@pytest.mark.slow
def test_s3_failing_15_percent_of_requests(s3_faulty, tiny_model_dir, ray_head, tmp_path):
    """503 or connection reset on 15% of all requests (seeded): exactly once, exit 0."""
    fs, proxy = s3_faulty
    ids = _s3_shards(fs)
    proxy.mode, proxy.fail_share = "mixed", 0.15
    job = Job(tmp_path, _s3_overrides(tiny_model_dir, ray_head.address, proxy.url))
    assert job.wait(timeout=400) == 0, job.output[-3000:]
    assert proxy.faults > 0
    assert sorted(_s3_ids(fs)) == sorted(ids)


@pytest.mark.slow
def test_s3_outage_mid_run_names_the_cause_then_rerun_completes(s3_faulty, tiny_model_dir, ray_head, tmp_path):
    fs, proxy = s3_faulty
    ids = _s3_shards(fs, n=16)
    from s3_util import BUCKET
    overrides = _s3_overrides(tiny_model_dir, ray_head.address, proxy.url, "cluster.num_workers=1")
    job = Job(tmp_path, overrides)
    deadline = time.time() + 240
    while len(fs.glob(f"{BUCKET}/out/t/_committed/*.json")) < 2 and job.proc.poll() is None:
        assert time.time() < deadline, job.output[-3000:]
        time.sleep(0.2)
    proxy.outage("503")
    t_fault = time.time()
    rc = job.wait(timeout=VERDICT_S + 60)
    took = time.time() - t_fault
    assert rc == 1, job.output[-3000:]
    assert took < VERDICT_S, f"verdict after {took:.0f} s"
    print(f"S3 outage: exit {rc} {took:.1f} s after the outage began; {job.output.strip().splitlines()[-2][:300]}")
    text = job.output
    assert "job failed:" in text and "no worker left" not in text
    verdict = [ln for ln in text.splitlines() if ln.startswith("job failed:")][0]
    # s3fs turns the 503 SlowDown answer into OSError(EBUSY, "Please reduce your request rate.")
    assert "Please reduce your request rate" in verdict or "SlowDown" in verdict or "503" in verdict, verdict
    proxy.restore()
    rerun = Job(tmp_path, overrides, name="rerun")
    assert rerun.wait(timeout=300) == 0, rerun.output[-3000:]
    assert sorted(_s3_ids(fs)) == sorted(ids)


# ---- a full disk ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_full_output_disk_names_the_cause_leaves_no_torn_marker_then_rerun(tiny_model_dir, ray_head, tmp_path):
    ids = shards(tmp_path / "in", files=2, rows=10)
    with small_disk(8) as disk:
        ballast = disk / "ballast"
        overrides = job_overrides(tiny_model_dir, str(tmp_path / "in"), str(disk / "out"),
                                  f"cluster.address={ray_head.address}", "input.rows_per_unit=2",
                                  "sampling.max_tokens=24", "storage.retries=2", "storage.retry_backoff_s=0.1")
        job = Job(tmp_path, overrides)
        _wait_for_markers(disk / "out" / "t", 2, job)
        # the disk fills up mid-run (unbuffered writes: a buffered file's close would retry the
        # write that hit ENOSPC and raise it here, depending on how full the last write found it)
        fill_until_full(disk, chunk=1 << 16, name=ballast.name)
        t_full = time.time()
        rc = job.wait(timeout=VERDICT_S + 60)
        assert rc == 1 and time.time() - t_full < VERDICT_S, job.output[-3000:]
        print(f"full disk: exit {rc} {time.time() - t_full:.1f} s after the disk filled")
        assert "No space left on device" in job.output and "no worker left" not in job.output
        for marker in (disk / "out" / "t" / "_committed").glob("*.json"):
            json.loads(marker.read_text())                     # every marker whole: none torn
        ballast.unlink()                                       # space is freed; the same command resumes
        rerun = Job(tmp_path, overrides, name="rerun")
        assert rerun.wait(timeout=300) == 0, rerun.output[-3000:]
        check_exactly_once(read_run(disk / "out" / "t"), ids)


# ---- two drivers, signals ---------------------------------------------------------------------------
@pytest.mark.slow
def test_second_driver_on_a_live_run_is_refused(tiny_model_dir, ray_head, tmp_path):
    """The first driver is held before it hands out any unit (debug.hold_dispatch_file) while the
    second tries, so it is provably live however slow the machine; released, it finishes."""
    ids = shards(tmp_path / "in", files=3, rows=16)
    hold = tmp_path / "hold"
    hold.touch()
    overrides = _overrides(tiny_model_dir, tmp_path, ray_head.address, "cluster.num_workers=1",
                           f"debug.hold_dispatch_file={hold}")
    first = Job(tmp_path, overrides, name="first")
    lease = tmp_path / "out" / "t" / "_lease"
    deadline = time.time() + 240
    while not list(lease.glob("*.json")):
        assert time.time() < deadline and first.proc.poll() is None, first.output[-3000:]
        time.sleep(0.1)
    second = Job(tmp_path, overrides, name="second")
    assert second.wait(timeout=240) == 3, second.output[-3000:]
    assert first.proc.poll() is None, "the first driver ended before the second tried: nothing was tested"
    assert not list((tmp_path / "out" / "t" / "_committed").glob("*.json")), "the hold let units through"
    assert f"being generated by another driver: held by pid {first.proc.pid}" in second.output
    hold.unlink()
    assert first.wait(timeout=300) == 0, first.output[-3000:]
    check_exactly_once(read_run(tmp_path / "out" / "t"), ids)


def _ray_daemons(started_by: int) -> set[int]:
    """Pids of the raylet and GCS server of the local Ray that process `started_by` started (its
    session folder ends in that pid: session_<date>_<time>_<pid>)."""
    session = re.compile(rf"session_[0-9_-]+_{started_by}(/|$)")
    pids = set()
    for entry in Path("/proc").iterdir():
        args = _cmdline(int(entry.name)) if entry.name.isdigit() else []
        if args and os.path.basename(args[0]) in ("raylet", "gcs_server") and any(map(session.search, args)):
            pids.add(int(entry.name))
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_mid_run_stops_cleanly_then_resume(sig, tiny_model_dir, tmp_path):
    """The job's own local Ray (no cluster address), as the README demo runs it, with the default
    token location in a fresh HOME: the token file is private, a signal stops dispatch, the job says
    what was committed and how to resume, exits 128 + signal, and leaves no Ray process behind. After
    SIGTERM (what Ray, Kubernetes and schedulers send) the same command resumes and completes exactly
    once; both signals stop through the same StopRequest, so SIGINT's resume is that one."""
    ids = shards(tmp_path / "in", files=2, rows=24)    # 25 units: the grace commits only those in flight (<= 3)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
    env.update(HOME=str(home), RAY_AUTH_MODE="token",    # the suite's kernel and model caches, as a used HOME has
               SPECPIPE_KERNEL_CACHE=str(kernel_cache_dir()), SPECPIPE_CACHE=str(cache_root()))
    overrides = job_overrides(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"), "input.rows_per_unit=2",
                              "sampling.max_tokens=12", "cluster.num_workers=1", "cluster.shutdown_grace_s=5")
    job = Job(tmp_path, overrides, env=env)
    _wait_for_markers(tmp_path / "out" / "t", 2, job)
    assert _ray_daemons(job.proc.pid), "the job's own Ray daemons were not found: the check below would be empty"
    token = home / ".ray" / "auth_token"
    assert (token.stat().st_mode & 0o777, token.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    job.proc.send_signal(sig)
    t_sig = time.time()
    assert job.wait(timeout=90) == 128 + sig, job.output[-3000:]
    assert time.time() - t_sig < 60
    print(f"{sig.name}: exit {128 + sig} {time.time() - t_sig:.1f} s after the signal")
    text = job.output
    assert f"interrupted by {sig.name}:" in text and "units committed" in text
    assert "resume with:" in text and "Traceback" not in text
    deadline = time.time() + 20
    while _ray_daemons(job.proc.pid) and time.time() < deadline:
        time.sleep(0.5)
    assert not _ray_daemons(job.proc.pid), "the job's Ray processes outlived it"
    committed = len(list((tmp_path / "out" / "t" / "_committed").glob("*.json")))
    assert 2 <= committed < 25
    if sig != signal.SIGTERM:
        return
    rerun = Job(tmp_path, overrides, env=env, name="rerun")
    assert rerun.wait(timeout=300) == 0, rerun.output[-3000:]
    check_exactly_once(read_run(tmp_path / "out" / "t"), ids)
    assert (token.stat().st_mode & 0o777) == 0o600


# ---- refused before any work ------------------------------------------------------------------------
def test_bad_locations_and_pickled_models_exit_2_before_ray(tiny_model_dir, tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", prompt_rows(3, "a"))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    (tmp_path / "afile").write_text("x")
    unreachable = "cluster.address=127.0.0.1:1"                # any Ray work would hang or fail differently
    cases = {
        "pickle": ([f"models.target={pickled}"], "models.target: model directory .* pickled checkpoints"),
        "file": ([f"output.path={tmp_path / 'afile'}"], "afile is a file; output.path must be a folder"),
        "inside": ([f"output.path={tmp_path / 'in' / 'out'}"], "lies inside input.path"),
    }
    for name, (extra, pattern) in cases.items():      # the driver's refusals, in this process
        args = job_overrides(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"), unreachable, *extra)
        with pytest.raises((InputError, OutputError), match=pattern):
            run_job(job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"), unreachable, *extra))
    # and one through the command line: exit 2 with the message
    proc = subprocess.run([sys.executable, "jobs/generate.py", *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and re.search(pattern, proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()
