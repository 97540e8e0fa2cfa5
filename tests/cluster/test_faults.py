"""The fault plan without Ray: which worker a drill hits, that every hook does nothing at the debug
defaults, and the driver's hold on dispatch. (The drills themselves, in real Ray processes:
test_drills.py, test_pipeline.py.)"""
from __future__ import annotations

import pytest

from pipeline.cluster import faults
from pipeline.cluster.faults import FaultPlan
from pipeline.job.config import DebugConfig


class Exited(Exception):
    pass


@pytest.fixture
def fatal(monkeypatch):
    """exit_now and hang raise instead of ending or blocking the test process; the calls are recorded."""
    calls = []

    def record(kind):
        def act():
            calls.append(kind)
            raise Exited(kind)
        return act
    monkeypatch.setattr(faults, "exit_now", record("exit"))
    monkeypatch.setattr(faults, "hang", record("hang"))
    return calls


def run_hooks(plan: FaultPlan, steps: int = 50) -> str | None:
    try:
        plan.on_load()
        for n in range(1, steps + 1):
            plan.after_step(n)
        plan.before_commit()
    except Exited as e:
        return str(e)
    return None


def test_defaults_do_nothing(fatal):
    for index, incarnation in ((0, 0), (1, 0), (0, 1)):
        assert run_hooks(FaultPlan.from_config(DebugConfig(), index, incarnation)) is None
    assert fatal == []


@pytest.mark.parametrize("debug, first_w0, others", [
    (DebugConfig(crash_worker_after_steps=5), "exit", None),
    (DebugConfig(hang_worker_after_steps=5), "hang", None),
    (DebugConfig(hang_load=True), "hang", None),
    (DebugConfig(crash_before_commit=True), "exit", "exit"),      # every worker, every incarnation
])
def test_only_the_first_incarnation_of_worker_0_hangs_or_crashes(fatal, debug, first_w0, others):
    assert run_hooks(FaultPlan.from_config(debug, 0, 0)) == first_w0
    assert run_hooks(FaultPlan.from_config(debug, 1, 0)) == others
    assert run_hooks(FaultPlan.from_config(debug, 0, 1)) == others     # its replacement finishes the job


def test_a_step_drill_fires_at_its_step(fatal):
    plan = FaultPlan.from_config(DebugConfig(crash_worker_after_steps=7), 0, 0)
    for n in range(1, 7):
        plan.after_step(n)
    assert fatal == []
    with pytest.raises(Exited):
        plan.after_step(7)


def test_the_driver_holds_dispatch_while_the_hold_file_exists(tmp_path):
    assert not FaultPlan.for_driver(DebugConfig()).holds_dispatch()
    hold = tmp_path / "hold"
    plan = FaultPlan.for_driver(DebugConfig(hold_dispatch_file=str(hold)))
    assert not plan.holds_dispatch()
    hold.touch()
    assert plan.holds_dispatch()
    hold.unlink()
    assert not plan.holds_dispatch()
