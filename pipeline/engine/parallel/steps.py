"""One driver of the round: rank 0 sends each step to the other ranks of its replica, which run it.

Rank 0's runner owns everything the round decides (requests, drafts, verification, commit). Each
operation of its runner that runs the target or moves KV (a forward, a prefix copy, a tree's path
move) is first broadcast as a small message (slots, starts, tokens, what logits: JSON), then run on
every rank at once, so the sharded forward's collectives happen in the same order everywhere and no
rank decides alone. Commit and rollback are lengths the next message carries (the starts).

While rank 0 has no step to send (no rows yet, a unit being written), it sends a beat every
`beat_s`, so an idle replica is never taken for a hung one; a beat that fails means a rank is gone,
and the next step raises it. Where rank 0 reads the ranks' heartbeats (group.Pulses), it looks at them
every third of a beat, whatever it is doing: a rank silent past the replica's timeout while rank 0 is
idle is a loss the next step raises at once, and a step whose collective fails names the rank that
stopped answering and for how long. `serve` is the other ranks' loop: build a runner when told (then
mark it built), then run each step it receives, until told to stop or a collective fails (rank 0
gone: RankLost).

Knows nothing about models' insides, requests or Ray.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .group import HEARTBEAT_S, Pulses, RankGroup, RankLost

OPS = ("forward", "copy_prefix", "move_path")


@dataclass
class TensorParallel:
    """A runner's place in its replica: the group, and on rank 0 the Peers its steps go through.
    timeout_s bounds each collective once every rank serves (the load before it has the group's own)."""
    group: RankGroup
    timeout_s: float = 300.0
    peers: "Peers | None" = None

    @property
    def size(self) -> int:
        return self.group.size


class Peers:
    """Rank 0's link to the other ranks: `step(op, **args)` sends a step and holds the group while
    rank 0 runs its own part; a beat keeps idle ranks from timing out. pulses: the ranks' heartbeats
    (None: not read); startup_s bounds the ranks' runner builds (their kernels measured)."""

    def __init__(self, group: RankGroup, beat_s: float, pulses: Pulses | None = None, startup_s: float = 300.0):
        self.group, self.beat_s, self.pulses, self.startup_s = group, beat_s, pulses, startup_s
        self._lock = threading.RLock()
        self._last = time.monotonic()
        self._error: RankLost | None = None     # the first rank loss seen: every later step raises it
        self._closed = threading.Event()
        threading.Thread(target=self._beat, name="tp-beat", daemon=True).start()

    @contextlib.contextmanager
    def step(self, op: str, **args):
        """Send `op` with `args` to every rank, then run the caller's own part (the with-block)."""
        with self._lock:
            if self._error is not None:
                raise self._error
            try:
                self.group.broadcast_message({"op": op, **args})
                yield
            except RankLost as e:
                self._error = self._named(e, f"rank 0 waited on a step ({op})")
                raise self._error from None
            finally:
                self._last = time.monotonic()

    def _named(self, e: RankLost, phase: str) -> RankLost:
        """`e`, led by the rank that stopped beating, where one did (beyond a few beats) and `e` does not
        already say so."""
        if e.heard or self.pulses is None:
            return e
        lost = self.pulses.stopped(phase, past_s=4 * HEARTBEAT_S)
        return e if lost is None else RankLost(f"{lost}; {e}")

    def runner(self, config: dict, kernels: dict, timeout_s: float, own_bytes: int) -> dict[int, int]:
        """Every rank builds its runner of `config` (engine config fields, max_num_seqs resolved) and
        `kernels`; once all are built, returns each rank's weight bytes (rank 0's: own_bytes) and
        bounds every later collective by timeout_s."""
        with self.step("runner", config=config, kernels=kernels, timeout_s=timeout_s):
            if self.pulses is not None:
                self.pulses.wait_for("built", "building its runner (loading and measuring its kernels)",
                                     self.startup_s)
            held = _weight_bytes(self.group, own_bytes)
        self.group.set_timeout(timeout_s)
        return held

    def _beat(self) -> None:
        while not self._closed.wait(self.beat_s / 3):
            self._listen()
            if time.monotonic() - self._last < self.beat_s or not self._lock.acquire(timeout=1.0):
                continue
            try:
                if self._error is None and not self._closed.is_set():
                    self.group.broadcast_message({"op": "beat"})
            except RankLost as e:
                self._error = self._named(e, "rank 0 was idle")
            finally:
                self._last = time.monotonic()
                self._lock.release()

    def _listen(self) -> None:
        """Read the ranks' heartbeats (keeping their silences current); a rank silent past the bound while
        no step runs is this replica's loss, which the next step raises."""
        if self.pulses is None or self._error is not None:
            return
        try:
            if self._lock.acquire(blocking=False):       # no step runs: silence here is the idle phase's
                try:
                    self.pulses.check("rank 0 was idle")
                finally:
                    self._lock.release()
            else:
                self.pulses.silent()
        except RankLost as e:
            self._error = e
        except RuntimeError:                             # the store is gone: the replica is closing
            pass

    def stop(self) -> None:
        """Tell every rank to leave its loop (they exit cleanly); idempotent."""
        if self._closed.is_set():
            return
        with self._lock:
            self._closed.set()
            if self._error is None:
                with contextlib.suppress(RankLost):
                    self.group.broadcast_message({"op": "stop"})


def _weight_bytes(group: RankGroup, own: int) -> dict[int, int]:
    """Each rank's weight bytes on every rank (one all-reduce, each rank filling its own entry)."""
    import torch
    held = torch.zeros(group.size, dtype=torch.float64, device=group.device)
    held[group.rank] = own
    group.all_reduce(held)
    return {r: int(b) for r, b in enumerate(held.tolist())}


def serve(group: RankGroup, build: Callable[[dict, dict], object],
          after_step: Callable[[int], None] = lambda steps: None,
          mark: Callable[[str], None] = lambda name: None) -> int:
    """A rank's loop (ranks 1..N-1): each message from rank 0 run on this rank's runner. `build(config,
    kernels)` makes the runner, whose `weight_bytes` (what this rank's weights hold) rank 0 gathers;
    `mark("built")` then tells rank 0 (its heartbeat's mark); `after_step(steps)` is called after each
    step run. Returns the steps run when told to stop; raises RankLost when rank 0 is gone."""
    runner, steps = None, 0
    while True:
        message = group.broadcast_message()
        op = message.pop("op")
        if op == "stop":
            return steps
        if op == "beat":
            continue
        if op == "runner":
            runner = build(message["config"], message["kernels"])
            mark("built")
            _weight_bytes(group, runner.weight_bytes)
            group.set_timeout(message["timeout_s"])
            continue
        if op not in OPS or runner is None:
            raise RuntimeError(f"rank {group.rank}: unexpected step {op!r}")
        getattr(runner, op)(**message)
        steps += 1
        after_step(steps)
