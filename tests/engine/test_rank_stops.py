"""A tensor-parallel rank that stops answering fails its replica within the replica's timeout, in every
phase, with a RankLost that says which rank stopped answering, for how long and in which phase.

The rank is a real process (tp_util's, as the job's: its heartbeat from its start) that is frozen by
SIGSTOP (every thread stopped, its sockets left open: what a hung process, a swapped-out one or a
partitioned node looks like to its peers, and what no closed socket reveals): by its own fault plan
while it loads, as it builds its runner and after 3 steps, or by the test while rank 0 is idle. A rank
that is only slow keeps beating: it is told apart, and its phase's own deadline names it as slow.
"""
import os
import signal
import time

import pytest

from conftest import make_engine, mixed_prompts
from pipeline.cluster.faults import FaultPlan
from pipeline.engine import SamplingParams
from pipeline.engine.parallel.group import RankLost
from tp_util import Replica, save_model

TIMEOUT_S = 3.0            # the replica's collective timeout: a rank silent this long has stopped
SLACK_S = 6.0              # beyond it: heartbeat reads, the process starts, Python


@pytest.fixture(scope="module")
def target_dir(target_model, tmp_path_factory):
    return save_model(target_model, tmp_path_factory.mktemp("stop-target"))


def _engine(replica, target_model):
    return make_engine(replica.shard(target_model), "none", None, max_num_seqs=2, max_model_len=64, tp=replica.tp)


def _decode(engine, prompts, max_tokens=24):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0))
    while engine.has_unfinished():
        engine.step()


def _stopped(proc) -> bool:
    with open(f"/proc/{proc.pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "T"


def test_a_rank_stopped_while_loading_fails_the_replica_within_the_timeout(target_dir):
    t0 = time.monotonic()
    with pytest.raises(RankLost, match=r"rank 1 of 2 stopped answering: no heartbeat for \d+ s \(the bound is "
                                       r"3 s\) while loading its part of the target"):
        Replica(target_dir, 2, timeout_s=TIMEOUT_S, startup_s=300, drill=FaultPlan(stop_rank_in="load"))
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S + 10        # + the rank process's start (torch)


@pytest.mark.slow
def test_a_rank_stopped_building_its_runner_fails_the_replica_within_the_timeout(target_dir, target_model):
    replica = Replica(target_dir, 2, timeout_s=TIMEOUT_S, startup_s=300, drill=FaultPlan(stop_rank_in="build"))
    try:
        t0 = time.monotonic()
        with pytest.raises(RankLost, match=r"rank 1 of 2 stopped answering: no heartbeat for \d+ s .* while "
                                           r"building its runner"):
            _engine(replica, target_model)
        assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S and _stopped(replica.procs[0])
    finally:
        replica.kill()


@pytest.mark.slow
def test_a_rank_stopped_mid_run_fails_the_next_step_within_the_timeout(target_dir, target_model):
    replica = Replica(target_dir, 2, timeout_s=TIMEOUT_S, startup_s=300, drill=FaultPlan(stop_rank_in="step"))
    try:
        engine = _engine(replica, target_model)
        steps = 0
        with pytest.raises(RankLost, match=r"rank 1 of 2 stopped answering: no heartbeat for \d+ s \(the bound is 3 s\) "
                                           r"while rank 0 waited on a step \(forward\); tensor-parallel .* failed on "
                                           r"rank 0") as lost:
            for i, p in enumerate(mixed_prompts(2, target_model.config.vocab_size, seed=3)):
                engine.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0))
            while engine.has_unfinished():
                t0 = time.monotonic()
                engine.step()
                steps += 1
        assert steps >= 1 and time.monotonic() - t0 < TIMEOUT_S + SLACK_S, lost.value   # it ran, then stopped
        assert _stopped(replica.procs[0])
        with pytest.raises(RankLost, match="stopped answering"):        # the replica stays lost
            engine.step()
    finally:
        replica.kill()


@pytest.mark.slow
def test_a_rank_stopped_while_rank_0_is_idle_fails_the_next_step_at_once(target_dir, target_model):
    replica = Replica(target_dir, 2, timeout_s=TIMEOUT_S, startup_s=300)
    try:
        engine = _engine(replica, target_model)
        prompts = mixed_prompts(2, target_model.config.vocab_size, seed=4)
        _decode(engine, prompts[:1], max_tokens=4)                     # the replica works
        os.kill(replica.procs[0].pid, signal.SIGSTOP)
        time.sleep(TIMEOUT_S + 3)                                       # idle past the bound
        t0 = time.monotonic()
        with pytest.raises(RankLost, match=r"rank 1 of 2 stopped answering: no heartbeat for \d+ s \(the bound is "
                                           r"3 s\) while rank 0 was idle"):
            _decode(engine, prompts[1:])
        assert time.monotonic() - t0 < 1.0                              # known already: no timeout waited
    finally:
        replica.kill()


@pytest.mark.slow
def test_a_slow_rank_that_answers_is_named_slow_at_its_phase_deadline(target_dir, target_model):
    """A rank whose runner build outlasts the startup bound but keeps beating is not taken for a stopped
    one (it outlasts the collective timeout many times over); the startup bound names it slow."""
    replica = None
    try:
        t0 = time.monotonic()
        # a busy machine may keep the rank loading past the bound (then the replica's opening raises): slow
        # there too, still answering
        with pytest.raises(RankLost, match=r"rank 1 of 2 still (building its runner|loading its part of the target)"
                                           r" .*after 15 s \(it answers: slow, not stopped\)"):
            replica = Replica(target_dir, 2, timeout_s=1.0, startup_s=15.0, drill=FaultPlan(rank_build_delay_s=60))
            _engine(replica, target_model)
        assert time.monotonic() - t0 >= 15
    finally:
        if replica is not None:
            replica.kill()
