"""The driver's hand-out policy, without Ray: units spread over all live workers, also while some are
still loading, and a large queue keeps every ready worker full."""
import collections
from dataclasses import dataclass, field

from pipeline.cluster.driver import _hand_out
from pipeline.io.reader import Unit


@dataclass
class _W:
    index: int
    is_ready: bool
    units: dict = field(default_factory=dict)


@dataclass
class _Pool:
    """The part of WorkerPool that _hand_out reads and calls."""
    workers: list
    max_units: int

    @property
    def ready(self):
        return [w for w in self.workers if w.is_ready]

    @property
    def live(self):
        return self.workers

    def in_flight(self):
        return sum(len(w.units) for w in self.workers)

    def submit(self, w, unit):
        w.units[unit.uid] = unit


def _units(n):
    return collections.deque(Unit(f"u{i}", "f", "f", "parquet", 6 * i, 6 * i + 6) for i in range(n))


def test_first_ready_worker_takes_only_its_share_of_a_small_job():
    pool = _Pool([_W(0, True), _W(1, False)], max_units=4)
    queue = _units(4)
    _hand_out(queue, pool)
    assert len(pool.workers[0].units) == 2 and len(queue) == 2      # w1 is still loading: 2 wait for it
    pool.workers[1].is_ready = True
    _hand_out(queue, pool)
    assert [len(w.units) for w in pool.workers] == [2, 2] and not queue


def test_large_jobs_fill_every_worker_to_max_units():
    pool = _Pool([_W(0, True), _W(1, True)], max_units=3)
    queue = _units(20)
    _hand_out(queue, pool)
    assert [len(w.units) for w in pool.workers] == [3, 3] and len(queue) == 14


def test_a_lone_worker_gets_everything_once_the_others_are_gone():
    pool = _Pool([_W(0, True)], max_units=8)
    queue = _units(5)
    _hand_out(queue, pool)
    assert len(pool.workers[0].units) == 5 and not queue
