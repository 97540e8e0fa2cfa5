"""A lease: at most one live holder of a named thing (a run, a synthetic-data slot) at a time, across
machines, on any fsspec store.

Leases are generations: `<folder>/<generation>.json`, created with `create_exclusive`, so of two
drivers racing for the same generation exactly one wins. The holder rewrites its own generation's
file with a heartbeat; a lease whose holder stopped heartbeating for `ttl_s` (or released it) is
taken over by creating the next generation. A holder that finds a newer generation than its own has
lost the lease (its heartbeats stalled past the TTL and someone took over) and must stop: the
generation number is the fencing token.

A holder on the same host whose process is gone (a killed driver) counts as expired at once.

Clocks: expiry compares the heartbeat's wall-clock time with the reader's, so clocks across machines
must agree to well within the TTL (60 s by default).

Knows nothing about runs, units or Ray.
"""
from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import threading
import time
from dataclasses import dataclass, field

from .storage import RetryPolicy, create_exclusive, describe, put_atomic, retrying

log = logging.getLogger(__name__)


class LeaseHeld(RuntimeError):
    """Another live holder has the lease."""

    def __init__(self, message: str, holder: dict):
        super().__init__(message)
        self.holder = holder


def owner_info(**extra) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time(), **extra}


def describe_holder(holder: dict) -> str:
    age = time.time() - holder.get("heartbeat_at", 0)
    extra = "".join(f", {k} {v}" for k, v in holder.items()
                    if k not in ("host", "pid", "started_at", "heartbeat_at", "generation", "released"))
    return (f"pid {holder.get('pid')} on {holder.get('host')} (lease generation {holder.get('generation')}, "
            f"last heartbeat {age:.0f} s ago{extra})")


@dataclass
class Lease:
    fs: object
    folder: str
    generation: int
    record: dict
    ttl_s: float
    retry: RetryPolicy
    lost: threading.Event = field(default_factory=threading.Event)
    lost_reason: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def path(self) -> str:
        return _gen_path(self.folder, self.generation)

    def heartbeat(self) -> None:
        """Refresh our heartbeat; marks the lease lost if a newer generation exists."""
        newer = [g for g in _generations(self.fs, self.folder) if g > self.generation]
        if newer:
            holder = _read(self.fs, _gen_path(self.folder, max(newer))) or {}
            self._lose(f"taken over by {describe_holder(holder)}")
            return
        self.record["heartbeat_at"] = time.time()
        put_atomic(self.fs, self.path, json.dumps(self.record).encode())

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        self.lost.set()

    def start_heartbeats(self) -> "Lease":
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4) and not self.lost.is_set():
            try:
                retrying(self.retry, f"heartbeat {self.path}", self.heartbeat)
            except Exception as e:  # noqa: BLE001 -- the holder must hear of any failure
                self._lose(f"heartbeat failed: {describe(e)}")

    def release(self) -> None:
        """Stop heartbeats and mark the lease free (the next holder need not wait for the TTL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lost.is_set():
            return
        try:
            self.record.update(released=True, heartbeat_at=time.time())
            retrying(self.retry, f"release {self.path}",
                     lambda: put_atomic(self.fs, self.path, json.dumps(self.record).encode()))
        except Exception as e:  # noqa: BLE001 -- an unreleased lease only expires later
            log.warning("could not release lease %s (%s); it expires after %.0f s", self.path, describe(e), self.ttl_s)


def acquire(fs, folder: str, owner: dict, ttl_s: float, retry: RetryPolicy = RetryPolicy()) -> Lease:
    """Take the lease at `folder` or raise LeaseHeld naming the live holder."""
    retrying(retry, f"create {folder}", lambda: fs.makedirs(folder, exist_ok=True))
    for _ in range(3):                    # a lost race for one generation re-reads and tries the next
        gens = retrying(retry, f"list {folder}", lambda: _generations(fs, folder))
        latest = max(gens, default=0)
        if latest:
            holder = retrying(retry, f"read lease {folder}", lambda: _read(fs, _gen_path(folder, latest)))
            if holder is not None and _is_live(holder, ttl_s):
                raise LeaseHeld(f"held by {describe_holder(holder)}", holder)
        record = {**owner, "generation": latest + 1, "heartbeat_at": time.time()}
        path = _gen_path(folder, latest + 1)
        if retrying(retry, f"create lease {path}", lambda: create_exclusive(fs, path, json.dumps(record).encode())):
            return Lease(fs, folder, latest + 1, record, ttl_s, retry)
    holder = _read(fs, _gen_path(folder, max(_generations(fs, folder)))) or {}
    raise LeaseHeld(f"held by {describe_holder(holder)}", holder)


def _is_live(holder: dict, ttl_s: float) -> bool:
    """Not released, heartbeat within the TTL, and -- for a holder on this host -- its process alive
    (a killed driver's rerun need not wait for the TTL)."""
    if holder.get("released") or time.time() - holder.get("heartbeat_at", 0) >= ttl_s:
        return False
    return holder.get("host") != socket.gethostname() or _pid_alive(holder.get("pid"))


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True                       # unknown: trust the heartbeat
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _gen_path(folder: str, generation: int) -> str:
    return posixpath.join(folder, f"{generation:010d}.json")


def _generations(fs, folder: str) -> list[int]:
    names = [posixpath.basename(p) for p in fs.glob(posixpath.join(folder, "*.json"))]
    return [int(n[:-5]) for n in names if n[:-5].isdigit()]


def _read(fs, path: str) -> dict | None:
    """A lease record; None if missing or unreadable (our writes are atomic, so an unparseable
    record was damaged by something else: it counts as expired, with a warning)."""
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError as e:
        log.warning("unreadable lease record %s (%s): treated as expired", path, describe(e))
        return None
