"""Storage faults without Ray: retries with bounded backoff, atomic markers (a torn marker is never
written and never crashes a reader), readers that find committed data before it is published, the
run lease, and input hygiene (hidden folders, output inside input, output that is a file)."""
import errno
import json
import os
import threading
import time

import fsspec
import pyarrow.parquet as pq
import pytest

from pipeline.errors import ConfigError
from pipeline.io.reader import InputConfig
from pipeline.io.storage import StorageConfig
from pipeline.job.config import load_config
from pipeline.io import lease as lease_mod
from pipeline.io.lease import LeaseHeld, acquire, owner_info
from pipeline.io.reader import InputError, check_output_outside_input, plan_units
from pipeline.io.storage import RetryPolicy, StorageError, create_exclusive, put_atomic, retrying
from pipeline.io.writer import OutputError, RunOutput
from pipeline.report.summary import load
from pipeline_util import prompt_rows, write_parquet
from pipeline_util import unit_tables

S = StorageConfig(retry_backoff_s=0.01, retry_max_backoff_s=0.02)
FAST = RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.02)
LOCAL = fsspec.filesystem("file")


# ---- retries ----------------------------------------------------------------------------------------
def test_transient_errors_are_retried_then_named():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"
    assert retrying(FAST, "write s3://b/x", flaky) == "ok" and len(calls) == 3
    calls.clear()
    with pytest.raises(StorageError, match=r"write s3://b/x: OSError: \[Errno 28\] No space left.*after 3 attempts"):
        retrying(FAST, "write s3://b/x", lambda: calls.append(1) or _raise(OSError(errno.ENOSPC, "No space left")))
    assert len(calls) == 3


def test_permanent_errors_are_not_retried():
    calls = []
    with pytest.raises(PermissionError):
        retrying(FAST, "write", lambda: calls.append(1) or _raise(PermissionError("denied")))
    assert calls == [1]
    assert list(RetryPolicy(attempts=6, backoff_s=0.5, max_backoff_s=2).delays()) == [0.5, 1, 2, 2, 2]


def _raise(e):
    raise e


# ---- atomic writes ----------------------------------------------------------------------------------
def test_put_atomic_never_leaves_a_torn_file(tmp_path, monkeypatch):
    target = tmp_path / "m.json"
    put_atomic(LOCAL, str(target), b'{"old": 1}')

    def full_disk(path, data):
        with open(path, "wb") as f:
            f.write(data[:3])                              # part of it reached the disk ...
        raise OSError(errno.ENOSPC, "No space left on device")   # ... then the disk was full
    monkeypatch.setattr("pipeline.io.storage._write_synced", full_disk)
    with pytest.raises(OSError, match="No space"):
        put_atomic(LOCAL, str(target), b'{"new": 2}')
    assert json.loads(target.read_text()) == {"old": 1}          # the old object, whole
    assert os.listdir(tmp_path) == ["m.json"]                    # no temp file left behind


def test_create_exclusive_has_one_winner(tmp_path):
    path = str(tmp_path / "lease.json")
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append((i, create_exclusive(LOCAL, path, f"{i}".encode()))))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results if won]
    assert len(winners) == 1 and (tmp_path / "lease.json").read_text() == str(winners[0])
    assert os.listdir(tmp_path) == ["lease.json"]


# ---- markers and readers ----------------------------------------------------------------------------
def test_torn_marker_counts_as_not_committed_and_the_rerun_repairs_it(tmp_path, caplog):
    out = RunOutput(str(tmp_path), "r", S)
    out.write_unit("u1", unit_tables(2), {"rows": 2})
    (tmp_path / "r" / "_committed" / "u2.json").write_bytes(b"")        # a 0-byte marker (old in-place write)
    (tmp_path / "r" / "_committed" / "u3.json").write_text('{"rows": 3')  # cut mid-write
    assert list(out.committed()) == ["u1"]
    assert "invalid commit marker" in caplog.text and "u2.json" in caplog.text
    assert not out.is_committed("u2") and out.is_committed("u1")
    out.write_unit("u2", unit_tables(1), {"rows": 1})                        # the unit runs again
    assert sorted(out.committed()) == ["u1", "u2"]


def test_readers_find_committed_data_before_it_is_published(tmp_path, monkeypatch):
    """A storage failure after the marker (publish) must neither fail the unit nor hide its data."""
    out = RunOutput(str(tmp_path), "r", S)
    out.write_unit("u1", unit_tables(2), {"rows": 2})

    def publish_fails(self, uid):
        raise StorageError("publish s3://x: EndpointConnectionError (gave up after 5 attempts)")
    monkeypatch.setattr(RunOutput, "publish", publish_fails)
    marker = out.write_unit("u2", unit_tables(3), {"rows": 3})               # committed all the same
    assert marker["unit"] == "u2" and out.is_committed("u2")
    assert not (tmp_path / "r" / "completions" / "u2.parquet").exists()
    for kind in ("completions", "rounds", "errors"):
        assert load(str(tmp_path / "r"), kind).num_rows == {"completions": 5, "rounds": 0, "errors": 0}[kind]
    monkeypatch.undo()
    assert out.roll_forward() == 1
    assert pq.read_table(tmp_path / "r" / "completions").num_rows == 5


def test_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "out").write_text("not a folder")
    with pytest.raises(OutputError, match="out is a file; output.path must be a folder"):
        RunOutput(str(tmp_path / "out"), "r", S).check_location()
    RunOutput(str(tmp_path / "fresh"), "r", S).check_location()          # not existing yet is fine


# ---- input hygiene ----------------------------------------------------------------------------------
def test_reader_skips_every_hidden_path_component(tmp_path):
    write_parquet(tmp_path / "a.parquet", prompt_rows(3, "a"))
    write_parquet(tmp_path / "_staging" / "u" / "completions.parquet", [{"id": "x", "text": "t"}])
    write_parquet(tmp_path / "run" / "_committed" / "b.parquet", [{"id": "x", "text": "t"}])
    write_parquet(tmp_path / ".cache" / "c.parquet", [{"id": "x", "text": "t"}])
    assert [u.rel for u in plan_units(InputConfig(path=str(tmp_path)), S)] == ["a.parquet"]


def test_output_inside_input_is_refused(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", prompt_rows(3, "a"))
    for inside in (tmp_path / "in" / "out" / "r", tmp_path / "in" / "r"):
        with pytest.raises(InputError, match="lies inside input.path"):
            check_output_outside_input(InputConfig(path=str(tmp_path / "in")), str(inside), S)
    with pytest.raises(InputError, match="lies inside"):
        check_output_outside_input(InputConfig(path=str(tmp_path / "in" / "*.parquet")), str(tmp_path / "in" / "o"), S)
    check_output_outside_input(InputConfig(path=str(tmp_path / "in")), str(tmp_path / "input2" / "r"), S)
    check_output_outside_input(InputConfig(path=str(tmp_path / "in" / "a.parquet")), str(tmp_path / "in" / "r"), S)


@pytest.mark.parametrize("run_id", ["..", ".", "a/b", "../x", "_x", "", "a\\b", "x" * 129, "a b"])
def test_hostile_run_ids_are_refused(run_id):
    with pytest.raises(ConfigError, match="run.run_id: "):
        load_config(None, [f"run.run_id={run_id}"])


# ---- the lease --------------------------------------------------------------------------------------
def test_lease_is_exclusive_until_released_or_expired(tmp_path, monkeypatch):
    folder = str(tmp_path / "_lease")
    first = acquire(LOCAL, folder, owner_info(run_id="r"), ttl_s=5, retry=FAST)
    with pytest.raises(LeaseHeld, match=r"held by pid \d+ on .*generation 1") as held:
        acquire(LOCAL, folder, owner_info(), ttl_s=5, retry=FAST)
    assert held.value.holder["pid"] == os.getpid()
    first.release()
    second = acquire(LOCAL, folder, owner_info(), ttl_s=5, retry=FAST)     # released: no wait
    assert second.generation == 2
    # expiry: the holder stops heartbeating; after the TTL another driver takes over, and the old
    # holder's next heartbeat finds the newer generation and reports the lease lost
    now = time.time()
    monkeypatch.setattr(lease_mod.time, "time", lambda: now + 6)
    third = acquire(LOCAL, folder, owner_info(), ttl_s=5, retry=FAST)
    assert third.generation == 3
    second.heartbeat()
    assert second.lost.is_set() and "taken over by" in second.lost_reason
    third.heartbeat()
    assert not third.lost.is_set()


def test_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    import subprocess
    import sys
    folder = str(tmp_path / "_lease")
    code = ("import fsspec, sys; from pipeline.io.lease import acquire, owner_info; "
            "acquire(fsspec.filesystem('file'), sys.argv[1], owner_info(), ttl_s=600)")
    subprocess.run([sys.executable, "-c", code, folder], check=True)     # takes it, then exits (killed)
    taken = acquire(LOCAL, folder, owner_info(), ttl_s=600, retry=FAST)  # no 600 s wait
    assert taken.generation == 2


def test_lease_heartbeats_keep_it_alive(tmp_path):
    folder = str(tmp_path / "_lease")
    holder = acquire(LOCAL, folder, owner_info(), ttl_s=4, retry=FAST).start_heartbeats()
    try:
        time.sleep(5)                                                    # longer than the TTL
        with pytest.raises(LeaseHeld):
            acquire(LOCAL, folder, owner_info(), ttl_s=4, retry=FAST)
    finally:
        holder.release()
    assert not holder.lost.is_set()
