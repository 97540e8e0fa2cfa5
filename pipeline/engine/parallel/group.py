"""The ranks of one tensor-parallel replica and the collectives between them.

A RankGroup is a torch.distributed process group made explicitly (gloo on CPU, NCCL on CUDA) over a
TCP store whose server rank 0 opens (`open_rendezvous`): no process-global default group, so several
replicas (and tests) can hold groups in one process. Its collectives are the few a sharded forward
needs: the row-parallel all-reduce, the vocabulary-split logits gathered on rank 0, and rank 0's
step header broadcast to the others.

A collective that fails (a peer's process died: its sockets close) or waits past the timeout raises
RankLost naming the group's rank, never a bare runtime error; `set_timeout` lengthens the bound
while ranks load and shortens it once every rank serves steps.

Knows nothing about models, runners or Ray.
"""
from __future__ import annotations

import datetime
import json
import socket

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class RankLost(RuntimeError):
    """A collective of a tensor-parallel replica failed: a rank died or stopped answering."""


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


def open_rendezvous(address: str, size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store server at `address` (host:port): the other ranks join it (RankGroup.join)."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), size, True, _seconds(timeout_s), wait_for_workers=False)


class RankGroup:
    """One rank's view of its replica's group: rank, size, backend, and the collectives."""

    def __init__(self, pg, rank: int, size: int, backend: str, device: torch.device, store=None):
        self.pg, self.rank, self.size, self.backend, self.device = pg, rank, size, backend, device
        self._store = store              # kept alive: rank 0's store server lives as long as the group

    @classmethod
    def join(cls, address: str, rank: int, size: int, device: str = "cpu", timeout_s: float = 300.0,
             store: dist.TCPStore | None = None) -> "RankGroup":
        """Join the group at `address` as `rank` of `size` (rank 0 passes the store it opened)."""
        backend = backend_for(device)
        if store is None:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), size, rank == 0, _seconds(timeout_s))
        prefixed = dist.PrefixStore("specpipe-tp", store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, size, _seconds(timeout_s))
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = _seconds(timeout_s)
            pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        return cls(pg, rank, size, backend, torch.device(device), store)

    def set_timeout(self, timeout_s: float) -> None:
        """Bound every later collective by `timeout_s` (gloo; NCCL keeps the bound it was made with)."""
        if self.backend == "gloo":
            self.pg.set_timeout(_seconds(timeout_s))

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise RankLost(f"tensor-parallel {what} failed on rank {self.rank} of {self.size} "
                           f"({self.backend}): a rank died or stopped answering: {e}") from None

    def _call(self, what: str, fn, *args) -> None:
        try:
            work = fn(*args)
        except RuntimeError as e:
            raise RankLost(f"tensor-parallel {what} failed on rank {self.rank} of {self.size} "
                           f"({self.backend}): {e}") from None
        self._wait(work, what)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (a row-parallel linear's partial outputs)."""
        self._call("all-reduce", self.pg.allreduce, [t])
        return t

    def gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Each rank's `t` concatenated along the last axis, on rank 0 (the vocabulary-split logits);
        the other ranks get their own part back."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._call("logits gather", self.pg.gather, [parts] if self.rank == 0 else [], [t], opts)
        return torch.cat(parts, dim=-1) if self.rank == 0 else t

    def broadcast_message(self, message: dict | None = None) -> dict:
        """Rank 0's `message` (JSON-able) on every rank: its length, then its bytes."""
        payload = (json.dumps(message, separators=(",", ":")).encode() if self.rank == 0 else b"")
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._call("step broadcast", self.pg.broadcast, [size], opts)
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device) if self.rank == 0
               else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device))
        self._call("step broadcast", self.pg.broadcast, [buf], opts)
        return message if self.rank == 0 else json.loads(buf.cpu().numpy().tobytes().decode())

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except (RuntimeError, AttributeError):
            pass
