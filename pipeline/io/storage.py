"""Storage primitives the commit protocol rests on, for any fsspec filesystem: bounded retries of
transient failures, atomic whole-object writes, and exclusive create.

- `retrying(policy, what, op)`: call `op` until it succeeds or the policy's attempts are spent,
  sleeping with bounded exponential backoff; errors that no retry can fix (permissions, a missing
  bucket, a path that is a file) are raised at once. The final error names the operation and path.
- `put_atomic(fs, path, data)`: a reader sees the old object, or the whole new one, never a part.
  Object stores give that with one PUT; on a local disk it is temp file + fsync + rename + directory
  fsync (a crash or a full disk leaves the old file or nothing, never a torn one).
- `arrow_input(fs, path)`: a file to hand to pyarrow, and whether pyarrow may use its threads on it
  (see its docstring: a Python file object read from Arrow's pools can abort the process at exit);
  `read_parquet(fs, path, columns)` reads a whole Parquet file through it.
- `create_exclusive(fs, path, data)`: True if this call created the object, False if it existed.
  Local disks: a hard link of a complete temp file (link fails if the name exists). S3: a PUT with
  `If-None-Match: *` (AWS S3, MinIO and moto honour it), then a read-back of our nonce; elsewhere
  (other fsspec stores, or an S3 server that ignores the condition): exists-check, write, read-back
  after a settle delay -- a best-effort fallback that two writers within the delay can both pass.

Knows nothing about runs, units or Ray.
"""
from __future__ import annotations

import logging
import os
import posixpath
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from ..errors import ConfigError

T = TypeVar("T")
log = logging.getLogger(__name__)

# Raised at once: retrying cannot fix them.
PERMANENT = (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError,
             TypeError, ValueError)
FALLBACK_SETTLE_S = 1.0


class StorageError(OSError):
    """A storage operation failed for good (after retries); names the operation, path and cause."""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5                # tries per operation (1 = no retry)
    backoff_s: float = 0.5           # first wait; doubles per retry
    max_backoff_s: float = 8.0       # cap on one wait

    def delays(self):
        delay = self.backoff_s
        for _ in range(self.attempts - 1):
            yield min(delay, self.max_backoff_s)
            delay *= 2


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def retrying(policy: RetryPolicy, what: str, op: Callable[[], T]) -> T:
    """op() with bounded retries of transient errors; StorageError naming `what` when they run out."""
    delays = policy.delays()
    while True:
        try:
            return op()
        except PERMANENT:
            raise
        except Exception as e:  # noqa: BLE001 -- s3fs/botocore/aiohttp raise many transient types
            delay = next(delays, None)
            if delay is None:
                raise StorageError(f"{what}: {describe(e)} (gave up after {policy.attempts} attempts)") from e
            log.warning("%s: %s; retrying in %.1f s", what, describe(e), delay)
            time.sleep(delay)


def is_local(fs) -> bool:
    return isinstance(fs, LocalFileSystem)


@contextmanager
def arrow_input(fs, path: str) -> Iterator[tuple[object, bool]]:
    """(file, threaded): `path` opened for pyarrow, and whether pyarrow may read it from its own threads.

    A local path opens as an Arrow-native file: pyarrow's I/O and CPU pools read and decode it without
    touching Python, so `threaded` is True. Any other filesystem's handle is a Python object, and
    pyarrow wraps what it reads from one in buffers that own Python objects. If a pool thread drops
    such a buffer after the interpreter has begun to exit, it cannot take the GIL, and the process
    aborts ("terminate called without an active exception", exit -6). CI saw this in a driver that had
    finished its job. `pq.read_table` on an fsspec handle, as the last line of a script, aborted 4 of
    10 runs here. So for a Python handle `threaded` is False: the caller must read it on its own
    thread (Parquet: `pre_buffer=False`, `use_threads=False`), and then no pool thread ever holds a
    Python buffer. pyarrow's JSON reader reads ahead on a pool thread even with `use_threads=False`:
    give it `pa.BufferReader(arrow_owned(f.read()))` instead."""
    if is_local(fs):
        with pa.OSFile(path, "rb") as f:
            yield f, True
    else:
        with fs.open(path, "rb") as f:
            yield f, False


def read_parquet(fs, path: str, columns=None, exclude=()) -> pa.Table:
    """A whole Parquet file as a table, through arrow_input (pool threads only on native files):
    `columns` to read (None: all), or every column but those in `exclude`."""
    with arrow_input(fs, path) as (f, threaded):
        pf = pq.ParquetFile(f, pre_buffer=threaded)
        if columns is None and exclude:
            columns = [c for c in pf.schema_arrow.names if c not in exclude]
        return pf.read(columns=columns, use_threads=threaded)


def arrow_owned(data: bytes) -> pa.Buffer:
    """`data` copied into Arrow-allocated memory, which Arrow's threads may drop without the GIL."""
    buf = pa.allocate_buffer(len(data))
    pa.FixedSizeBufferWriter(buf).write(data)
    return buf


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: str) -> str:
    folder, name = posixpath.split(path)
    return posixpath.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:12]}")


def put_atomic(fs, path: str, data: bytes) -> None:
    """Write the whole object or nothing (see the module docstring)."""
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    tmp = _temp_name(path)
    try:
        _write_synced(tmp, data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(posixpath.dirname(path))


def create_exclusive(fs, path: str, data: bytes) -> bool:
    """Create `path` holding `data` unless it exists. True if this call created it."""
    if is_local(fs):
        return _create_local(path, data)
    try:
        if fs.exists(path):
            return False
        if "s3" in _protocols(fs):
            fs.pipe_file(path, data, mode="create")
        else:
            fs.pipe_file(path, data)
            time.sleep(FALLBACK_SETTLE_S)
    except FileExistsError:              # s3fs maps 412 Precondition Failed to this
        return False
    return fs.cat_file(path) == data     # the read-back: catches servers that ignore the condition


def _protocols(fs) -> tuple:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def _create_local(path: str, data: bytes) -> bool:
    tmp = _temp_name(path)
    try:
        _write_synced(tmp, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(posixpath.dirname(path))
    return True


@dataclass
class StorageConfig:
    """Object-store access for s3:// input and output. Unset fields fall back to the standard AWS
    environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION). Keys given
    here are never written to the output (the stored config redacts them)."""
    endpoint_url: Optional[str] = None
    key: Optional[str] = None
    secret: Optional[str] = None
    region: Optional[str] = None
    retries: int = 4                        # retries of a failed storage call (output writes, markers, listings)
    retry_backoff_s: float = 0.5            # first wait before a retry; doubles per retry ...
    retry_max_backoff_s: float = 8.0        # ... up to this (defaults: ~15 s of retries per call)

    def __post_init__(self):
        if self.retries < 0 or self.retry_backoff_s < 0 or self.retry_max_backoff_s < self.retry_backoff_s:
            raise ConfigError("storage.retries/retry_backoff_s/retry_max_backoff_s: expected retries >= 0 "
                              "and 0 <= backoff <= max backoff")

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.retries + 1, self.retry_backoff_s, self.retry_max_backoff_s)

    def with_environment(self) -> "StorageConfig":
        """Unset fields filled from the driver's AWS environment, so workers on other machines
        (whose environment the driver does not control) see the same endpoint and credentials."""
        env = os.environ.get
        return replace(self, endpoint_url=self.endpoint_url or env("AWS_ENDPOINT_URL_S3") or env("AWS_ENDPOINT_URL"),
                       key=self.key or env("AWS_ACCESS_KEY_ID"), secret=self.secret or env("AWS_SECRET_ACCESS_KEY"),
                       region=self.region or env("AWS_REGION") or env("AWS_DEFAULT_REGION"))
