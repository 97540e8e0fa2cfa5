"""The ranks of one tensor-parallel replica and the collectives between them.

A RankGroup is a torch.distributed process group made explicitly (gloo on CPU, NCCL on CUDA) over a
TCP store whose server rank 0 opens (`open_rendezvous`): no process-global default group, so several
replicas (and tests) can hold groups in one process. Its collectives are the few a sharded forward
needs: the row-parallel all-reduce, the vocabulary-split logits gathered on rank 0, and rank 0's
step header broadcast to the others.

Every collective here is point-to-point sends and receives, which gloo runs at a third to a fifth of
the latency of its own all-reduce for a decoding step's small tensors (0.2-0.45 vs 0.95-1.6 ms for
896 floats between two processes of a 2-core machine: bench/research/allreduce.py; a forward does two
per layer): the all-reduce is each rank's tensor sent to every other rank and the parts summed in rank
order, so every rank holds the same bits.
Beyond EXCHANGE_MAX_RANKS ranks the library's all-reduce (a ring: less data per rank) runs instead.

A collective that fails (a peer's process died: its sockets close) or waits past the timeout raises
RankLost naming the group's rank, never a bare runtime error; `set_timeout` lengthens the bound
while ranks load and shortens it once every rank serves steps.

Every other rank beats on the rendezvous store from its own thread (`Heartbeat`: a counter raised every
HEARTBEAT_S, from before it loads until it leaves) and marks where it has got to (`mark`: loaded,
built). Rank 0 reads the beats (`Pulses`): a rank whose counter has not risen for the replica's
timeout has stopped answering (a frozen process, a lost node), whatever rank 0 is waiting on, which a
rank that is only slow (loading, measuring its kernels) never looks like.

Knows nothing about models, runners or Ray.
"""
from __future__ import annotations

import datetime
import json
import socket
import threading
import time

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
EXCHANGE_MAX_RANKS = 4          # up to this many ranks an all-reduce is an exchange (above), beyond it a ring
HEARTBEAT_S = 0.5               # a rank's beat on the store; silence is judged past max(timeout, 4 beats)
POLL_S = 0.1                    # rank 0's look at the store while it waits for the ranks' marks


class RankLost(RuntimeError):
    """A collective of a tensor-parallel replica failed: a rank died or stopped answering. `heard` is
    true where the heartbeats told (Pulses: a rank silent, or slow past its phase's deadline)."""
    heard = False


def _heard(message: str) -> RankLost:
    lost = RankLost(message)
    lost.heard = True
    return lost


def backend_for(device: str) -> str:
    """The collective backend of ranks on `device`: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(s))


def free_address(host: str) -> str:
    """host:port with a port free on this host now (the rendezvous rank 0 announces)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def _store(address: str, timeout_s: float, **options) -> dist.TCPStore:
    """A TCPStore at `address` (host:port): its server where options say is_master, else a client."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), timeout=_seconds(timeout_s), **options)


def _client(address: str, timeout_s: float) -> dist.TCPStore:
    return _store(address, timeout_s, is_master=False)


class Heartbeat:
    """Rank `rank`'s beat on the store at `address` (its own connection and thread) until `stop()`;
    `mark(name)` says the rank got there (rank 0's Pulses.wait_for reads it)."""

    def __init__(self, address: str, rank: int, timeout_s: float):
        self.rank, self._store = rank, _client(address, timeout_s)
        self._stop = threading.Event()
        self._store.add(f"alive/{rank}", 1)
        threading.Thread(target=self._beat, name=f"tp-heartbeat-{rank}", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._store.add(f"alive/{self.rank}", 1)
            except RuntimeError:            # rank 0's store is gone: the replica is over
                return

    def mark(self, name: str) -> None:
        self._store.set(f"{name}/{self.rank}", "1")

    def stop(self) -> None:
        self._stop.set()


class Pulses:
    """Rank 0's reading of ranks 1..size-1's heartbeats (its own connection to the store): how long each
    has been silent by rank 0's clock, and a rank silent past `timeout_s` named as stopped."""

    def __init__(self, address: str, size: int, timeout_s: float, clock=time.monotonic):
        self.size, self.timeout_s, self.clock = size, timeout_s, clock
        self._store = _client(address, timeout_s)
        self._lock = threading.Lock()           # the engine's thread and the idle beat's both read
        self._seen = {r: (0, clock()) for r in range(1, size)}    # rank -> (count, when it last rose)

    def silent(self) -> dict[int, float]:
        """Seconds since each rank's count last rose, for the ranks that have beaten (one not started yet
        is its phase's deadline's to judge)."""
        with self._lock:
            now = self.clock()
            for r, (count, when) in self._seen.items():
                latest = self._store.add(f"alive/{r}", 0)
                if latest != count:
                    self._seen[r] = (latest, now)
            return {r: now - when for r, (count, when) in self._seen.items() if count}

    def stopped(self, phase: str, past_s: float | None = None) -> RankLost | None:
        """The loss of the rank silent longest, where one has been silent over `past_s` (default: the
        bound, or four beats where that is less) while `phase`; else None."""
        limit = max(self.timeout_s, 4 * HEARTBEAT_S) if past_s is None else past_s
        silent = {r: s for r, s in self.silent().items() if s > limit}
        if not silent:
            return None
        r = max(silent, key=silent.get)
        return _heard(f"tensor-parallel rank {r} of {self.size} stopped answering: no heartbeat for "
                        f"{silent[r]:.0f} s (the bound is {self.timeout_s:g} s) while {phase}")

    def check(self, phase: str) -> None:
        """Raise the loss of a rank silent past the bound while `phase`, where there is one."""
        lost = self.stopped(phase)
        if lost is not None:
            raise lost

    def wait_for(self, name: str, phase: str, deadline_s: float) -> None:
        """Until every rank has marked `name`, checking the heartbeats meanwhile; RankLost past deadline_s."""
        t0 = self.clock()
        while True:
            with self._lock:
                missing = [r for r in range(1, self.size) if not self._store.check([f"{name}/{r}"])]
            if not missing:
                return
            self.check(phase)
            if self.clock() - t0 > deadline_s:
                raise _heard(f"tensor-parallel rank {missing[0]} of {self.size} still {phase} after "
                               f"{deadline_s:g} s (it answers: slow, not stopped)")
            time.sleep(POLL_S)


def open_rendezvous(address: str, size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store server at `address` (host:port): the other ranks join it (RankGroup.join)."""
    return _store(address, timeout_s, world_size=size, is_master=True, wait_for_workers=False)


class RankGroup:
    """One rank's view of its replica's group: rank, size, backend, and the collectives."""

    def __init__(self, pg, rank: int, size: int, backend: str, device: torch.device, store=None,
                 timeout_s: float = 300.0):
        self.pg, self.rank, self.size, self.backend, self.device = pg, rank, size, backend, device
        self._store = store              # kept alive: rank 0's store server lives as long as the group
        self.seconds: dict[str, float] = {}    # wall seconds spent in each kind of collective (benchmarks)
        self.timeout_s = timeout_s       # each wait's bound (set_timeout)

    @classmethod
    def join(cls, address: str, rank: int, size: int, device: str = "cpu", timeout_s: float = 300.0,
             store: dist.TCPStore | None = None) -> "RankGroup":
        """Join the group at `address` as `rank` of `size` (rank 0 passes the store it opened)."""
        backend = backend_for(device)
        if store is None:
            store = _store(address, timeout_s, world_size=size, is_master=rank == 0)
        prefixed = dist.PrefixStore("specpipe-tp", store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, size, _seconds(timeout_s))
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = _seconds(timeout_s)
            pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        return cls(pg, rank, size, backend, torch.device(device), store, timeout_s)

    def set_timeout(self, timeout_s: float) -> None:
        """Bound every later collective by `timeout_s` (gloo; NCCL keeps the bound it was made with)."""
        if self.backend == "gloo":
            self.pg.set_timeout(_seconds(timeout_s))
            self.timeout_s = timeout_s

    def _wait(self, work, what: str, peer: int | None = None) -> None:
        """Wait for `work`: a gloo send or receive by the group's current bound (their own wait has none:
        a peer that stopped, its socket open, would hold it forever)."""
        try:
            if self.backend == "gloo":
                work.wait(_seconds(self.timeout_s))
            else:
                work.wait()
        except RuntimeError as e:
            who = f"rank {peer}" if peer is not None else "a rank"
            raise RankLost(f"tensor-parallel {what} failed on rank {self.rank} of {self.size} "
                           f"({self.backend}): {who} died or stopped answering: {e}") from None

    def _call(self, what: str, fn, *args) -> None:
        t0 = time.perf_counter()
        try:
            work = fn(*args)
        except RuntimeError as e:
            raise RankLost(f"tensor-parallel {what} failed on rank {self.rank} of {self.size} "
                           f"({self.backend}): {e}") from None
        self._wait(work, what)
        self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - t0

    def _exchange(self, what: str, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> None:
        """Send sends[r] to rank r and receive recvs[r] from rank r, all at once."""
        t0 = time.perf_counter()
        try:
            works = ([(r, self.pg.send([t], r, 0)) for r, t in sends.items()]
                     + [(r, self.pg.recv([t], r, 0)) for r, t in recvs.items()])
        except RuntimeError as e:
            raise RankLost(f"tensor-parallel {what} failed on rank {self.rank} of {self.size} "
                           f"({self.backend}): {e}") from None
        for peer, work in works:
            self._wait(work, what, peer)
        self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - t0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (a row-parallel linear's partial outputs): the same bits on
        every rank (the parts added in rank order)."""
        if self.size > EXCHANGE_MAX_RANKS or self.backend != "gloo":
            self._call("all-reduce", self.pg.allreduce, [t])
            return t
        t = t.contiguous() if not t.is_contiguous() else t
        others = {r: torch.empty_like(t) for r in range(self.size) if r != self.rank}
        self._exchange("all-reduce", {r: t for r in others}, others)
        if self.size == 2:                   # a + b is b + a, bit for bit
            return t.add_(others[1 - self.rank])
        parts = [t if r == self.rank else others[r] for r in range(self.size)]
        total = parts[0] + parts[1]
        for part in parts[2:]:
            total += part
        return t.copy_(total)

    def gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Each rank's `t` concatenated along the last axis, on rank 0 (the vocabulary-split logits);
        the other ranks get their own part back."""
        t = t.contiguous()
        if self.rank != 0:
            self._exchange("logits gather", {0: t}, {})
            return t
        parts = {r: torch.empty_like(t) for r in range(1, self.size)}
        self._exchange("logits gather", {}, parts)
        return torch.cat([t, *parts.values()], dim=-1)

    def broadcast_message(self, message: dict | None = None) -> dict:
        """Rank 0's `message` (JSON-able) on every rank: its length, then its bytes."""
        others = range(1, self.size)
        if self.rank == 0:
            payload = json.dumps(message, separators=(",", ":")).encode()
            size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            self._exchange("step broadcast", {r: size for r in others}, {})
            self._exchange("step broadcast", {r: buf for r in others}, {})
            return message
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self._exchange("step broadcast", {}, {0: size})
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._exchange("step broadcast", {}, {0: buf})
        return json.loads(buf.cpu().numpy().tobytes().decode())

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except (RuntimeError, AttributeError):
            pass
