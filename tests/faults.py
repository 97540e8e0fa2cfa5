"""Tools for failure drills: a fault-injecting S3 reverse proxy, a second Ray node that can be lost,
and a small disk.

What is real here: the proxy is a real HTTP/1.1 server on loopback relaying real S3 requests (SigV4
headers, multipart, chunked bodies) to a real S3 protocol server (moto's ThreadedMotoServer); its
faults are a real 503 response or a real TCP reset. The node is a real `ray start --block` raylet
joining a real head, and losing it is a real SIGKILL. The small disk is a real tmpfs mount with a
real size limit, so a full disk is a real ENOSPC from the kernel.

Import it from a test module as `from faults import ...` (tests/ is on sys.path as for pipeline_util).
"""
from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlsplit

import pytest

FAULT_MODES = ("503", "reset", "mixed")
# Hop-by-hop headers (RFC 9110 7.6.1) end at the proxy. Transfer-Encoding is not among them here:
# a chunked request body is relayed with its framing byte for byte, so the header goes with it.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
               "te", "upgrade", "expect"}
_PIECE = 1 << 16


@dataclass
class ProxyRecord:
    """One request the proxy received, recorded when the proxy decided its fate (before anything
    was sent back, so a client that has its answer always finds its record). outcome: "forwarded"
    (passed on upstream; status = upstream's status once relayed), "503" (answered by the proxy,
    not forwarded), "reset" (connection dropped, not forwarded) or "error" (passed on, but
    forwarding failed: upstream unreachable or the client vanished mid-request)."""
    method: str
    target: str                 # request target as sent: path and query
    outcome: str
    status: int | None
    framing: str                # request body framing: "length", "chunked" or "none"
    expect_continue: bool       # the client sent `Expect: 100-continue`


class S3FaultProxy:
    """A threaded HTTP/1.1 reverse proxy on 127.0.0.1 (free port) in front of an S3 endpoint, which
    fails a share of requests on purpose.

    Forwarding: method, raw request target, every end-to-end header (Host unchanged, so SigV4
    signatures stay valid) and the body, streamed; a `Transfer-Encoding: chunked` body (aws-chunked
    or not) is relayed with its chunk framing and trailers untouched. `Expect: 100-continue` is
    answered by the proxy itself once it has decided to forward (never for a failed request), and
    is not passed on. Each request goes upstream on a fresh connection; the response (status,
    headers, body) is streamed back, re-chunked only when upstream sent no Content-Length.

    Faults, changeable at any time from another thread: `fail_share` (0..1) of requests fail,
    decided by one draw per request from `random.Random(seed)` - with one client making requests in
    sequence, the same seed fails the same requests. `mode` says how a request fails: "503" (an S3
    XML error, `error_code` SlowDown by default, status 503), "reset" (TCP RST instead of a response)
    or "mixed" (one more draw picks either, evenly). `outage()` fails every request until
    `restore()`. `fault_filter(method, target) -> bool`, if set, limits faults (share and outage
    alike) to the requests it accepts. A failed request is never forwarded: a failed PUT changes
    nothing upstream.

    Counters: `requests`, `forwarded` (passed on upstream), `faults` (ints) and `history` (a
    ProxyRecord per request), all updated before the client gets any answer.
    """

    def __init__(self, upstream_url: str, fail_share: float = 0.0, mode: str = "503", seed: int = 0,
                 error_code: str = "SlowDown", timeout: float = 120.0):
        parts = urlsplit(upstream_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http:// URL, got {upstream_url!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.timeout = timeout
        self.error_code = error_code
        self.fault_filter: Callable[[str, str], bool] | None = None
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._fail_share = 0.0
        self._mode = "503"
        self.fail_share, self.mode = fail_share, mode
        self._outage_mode: str | None = None
        self.requests = self.forwarded = self.faults = 0
        self.history: list[ProxyRecord] = []
        self._server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler, self)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"s3-fault-proxy-{self.port}", daemon=True)
        self._thread.start()

    # -- fault controls ---------------------------------------------------------------------------
    @property
    def fail_share(self) -> float:
        return self._fail_share

    @fail_share.setter
    def fail_share(self, share: float) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"fail_share must be within 0..1, got {share}")
        self._fail_share = float(share)

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"mode must be one of {FAULT_MODES}, got {mode!r}")
        self._mode = mode

    def outage(self, mode: str | None = None) -> None:
        """Every request fails (as `mode`, default the proxy's `mode`) until `restore()`."""
        if mode is not None and mode not in FAULT_MODES:
            raise ValueError(f"mode must be one of {FAULT_MODES}, got {mode!r}")
        self._outage_mode = mode or self._mode

    def restore(self) -> None:
        """Ends an outage; `fail_share` stays as set."""
        self._outage_mode = None

    @property
    def in_outage(self) -> bool:
        return self._outage_mode is not None

    def reset_counters(self) -> None:
        with self._lock:
            self.requests = self.forwarded = self.faults = 0
            self.history = []

    def records(self, outcome: str | None = None, method: str | None = None) -> list[ProxyRecord]:
        with self._lock:
            return [r for r in self.history if (outcome is None or r.outcome == outcome)
                    and (method is None or r.method == method)]

    def _decide(self, method: str, target: str, framing: str, expect: bool) -> ProxyRecord:
        """Counts and records the next request; record.outcome says its fate: "forwarded", "503"
        or "reset"."""
        with self._lock:
            self.requests += 1
            draw = self._rng.random()                   # one draw per request, whatever the settings
            eligible = self.fault_filter is None or self.fault_filter(method, target)
            if eligible and self._outage_mode is not None:
                outcome = self._outage_mode
            elif eligible and draw < self._fail_share:
                outcome = self._mode
            else:
                outcome = "forwarded"
            if outcome == "mixed":
                outcome = "503" if self._rng.random() < 0.5 else "reset"
            if outcome == "forwarded":
                self.forwarded += 1
            else:
                self.faults += 1
            record = ProxyRecord(method, target, outcome, 503 if outcome == "503" else None, framing, expect)
            self.history.append(record)
            return record

    # -- lifecycle ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops accepting, drops the open client connections and joins the server thread."""
        self._server.shutdown()
        self._server.drop_connections()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> "S3FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"S3FaultProxy({self.url} -> http://{self.upstream[0]}:{self.upstream[1]}, "
                f"fail_share={self.fail_share}, mode={self.mode!r}, outage={self.in_outage}, "
                f"requests={self.requests}, faults={self.faults})")


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, handler, proxy: S3FaultProxy):
        self.proxy = proxy
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        with self._open_lock:
            sockets = list(self._open)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"          # keep-alive, chunked, 100-continue as a client expects
    timeout = 120                          # an idle keep-alive connection ends after this

    def handle_expect_100(self) -> bool:
        return True                        # decided in _proxy: a failed request gets no 100

    def log_message(self, format, *args) -> None:
        pass

    def _proxy(self) -> None:
        proxy: S3FaultProxy = self.server.proxy
        self._response_started = False
        target = self.requestline.split(" ")[1] if self.requestline.count(" ") >= 2 else self.path
        expect = self.headers.get("Expect", "").lower() == "100-continue"
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        framing = "chunked" if chunked else ("length" if self.headers.get("Content-Length") else "none")
        record = proxy._decide(self.command, target, framing, expect)
        if record.outcome == "reset":
            # RST, no response: linger 0 makes close() abort the connection. The request (and any
            # body in flight) is never read or forwarded.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()        # the fd really closes when rfile/wfile do, in finish()
            return
        if record.outcome == "503":
            if expect:
                self.close_connection = True       # the body was never asked for: don't reuse
            else:
                try:
                    for _ in self._body_pieces(chunked):
                        pass                       # read and dropped: the connection stays usable
                except (OSError, ValueError):      # the client went away or sent a broken body
                    self.close_connection = True
                    return
            self._send_error_503()
            return
        try:
            self._forward(proxy, target, chunked, expect, record)
        except (OSError, ValueError, http.client.HTTPException) as err:
            record.outcome = "error"
            self.close_connection = True
            if not self._response_started:
                with contextlib.suppress(OSError):
                    self._send_simple(502, f"proxy could not forward: {err!r}".encode(), "text/plain")

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_OPTIONS = do_PATCH = _proxy

    def _body_pieces(self, chunked: bool) -> Iterator[bytes]:
        """The request body as it came off the wire (chunk framing included when chunked)."""
        rfile = self.rfile
        if chunked:
            while True:
                line = rfile.readline(65537)
                if not line.endswith(b"\n"):
                    raise ConnectionError("request body ended inside a chunk header")
                yield line
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while True:                            # trailer fields, then an empty line
                        line = rfile.readline(65537)
                        if not line.endswith(b"\n"):
                            raise ConnectionError("request body ended inside the trailer")
                        yield line
                        if line in (b"\r\n", b"\n"):
                            return
                left = size + 2                            # chunk data and its CRLF
                while left:
                    data = rfile.read(min(left, _PIECE))
                    if not data:
                        raise ConnectionError("request body ended inside a chunk")
                    left -= len(data)
                    yield data
        else:
            left = int(self.headers.get("Content-Length") or 0)
            while left:
                data = rfile.read(min(left, _PIECE))
                if not data:
                    raise ConnectionError("request body shorter than its Content-Length")
                left -= len(data)
                yield data

    def _forward(self, proxy: S3FaultProxy, target: str, chunked: bool, expect: bool, record: ProxyRecord) -> None:
        conn = http.client.HTTPConnection(*proxy.upstream, timeout=proxy.timeout)
        try:
            conn.putrequest(self.command, target, skip_host=True, skip_accept_encoding=True)
            listed = {h.strip().lower() for h in self.headers.get("Connection", "").split(",")}
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP and name.lower() not in listed:
                    conn.putheader(name, value)
            conn.endheaders()
            if expect:                                     # now the client may send the body
                self.send_response_only(100)
                self.end_headers()
            for piece in self._body_pieces(chunked):
                conn.send(piece)
            response = conn.getresponse()
            record.status = response.status
            self._relay_response(response)
        finally:
            conn.close()

    def _relay_response(self, response: http.client.HTTPResponse) -> None:
        self._response_started = True
        no_body = self.command == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
        length = response.getheader("Content-Length")
        rechunk = not no_body and length is None
        self.send_response_only(response.status, response.reason)
        listed = {h.strip().lower() for h in (response.getheader("Connection") or "").split(",")}
        for name, value in response.getheaders():
            low = name.lower()
            if low in _HOP_BY_HOP or low in listed or low == "transfer-encoding":
                continue
            self.send_header(name, value)
        if rechunk:
            self.send_header("Transfer-Encoding", "chunked")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if no_body:
            return
        while True:
            data = response.read(_PIECE)
            if not data:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if rechunk else data)
        if rechunk:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _send_error_503(self) -> None:
        proxy: S3FaultProxy = self.server.proxy
        request_id = uuid.uuid4().hex[:16].upper()
        message = ("Please reduce your request rate." if proxy.error_code == "SlowDown"
                   else "Service is unable to handle request.")
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{proxy.error_code}</Code>'
                f"<Message>{message}</Message><RequestId>{request_id}</RequestId>"
                f"<HostId>s3-fault-proxy</HostId></Error>").encode()
        self._send_simple(503, body, "application/xml", {"x-amz-request-id": request_id})

    def _send_simple(self, status: int, body: bytes, content_type: str, extra: dict | None = None) -> None:
        self.send_response_only(status)
        self.send_header("Content-Type", content_type)
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()


# ---- a second Ray node --------------------------------------------------------------------------
# Shorter GCS health checks (Ray's defaults: a check every 3 s, a node is dead after 5 missed, so a
# SIGKILLed raylet is declared dead ~15 s later). Set these in os.environ before the RayHead is
# created (it copies os.environ for `ray start`; the GCS reads RAY_<config> at start): ~5 s instead.
FAST_NODE_FAILURE_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
                         "RAY_health_check_failure_threshold": "3"}


def session_members(sid: int) -> list[int]:
    """Live processes in session `sid` (Linux /proc). `ray start --block` started with
    start_new_session leads its own session; its raylet and agents share its process group, but
    each Ray worker gets a process group of its own inside the session, so the session is what
    holds all of one node's processes."""
    from conftest import proc_members
    return proc_members(session=sid)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


class RayNode:
    """A second, worker node: a real `ray start --block --address=<head GCS>` on this machine,
    joining a conftest `RayHead`, with `num_cpus` CPUs and optional custom `resources` (e.g.
    {"node2": 1} to pin actors onto it). Started in its own session (start_new_session), so
    `stop()`/`kill()` reach exactly this node's processes, workers included.

    Temp dir: Ray 2.60 accepts `--temp-dir` on a non-head node ("can be specified per node") and it
    need not equal the head's: the node keeps the head's session name but puts its session dir,
    sockets and logs under its own dir. Without `--temp-dir` it takes the head's temp dir (from the
    head's GCS node info) and shares the head's session dir, its sockets suffixed `.1`. Both
    work (tried). By default each RayNode gets a fresh dir of its own (`temp_dir=None`), removed on
    stop, so its logs and sockets are its own; pass `temp_dir=head.temp_dir` to share.

    `kill()` SIGKILLs the node's raylet, as when the machine is lost: its workers notice within
    ~2 s and exit, `ray start --block` sees its raylet gone and takes down the node's agents, and
    the GCS declares the node dead once health checks fail (~15 s with Ray's defaults, ~5 s with
    FAST_NODE_FAILURE_ENV; measured here). Use `wait_for_nodes` for either.

    Note: like the head's, the node advertises the host's routable IP (Ray replaces loopback); two
    nodes on one host are told apart by node id."""

    def __init__(self, head, num_cpus: int = 1, resources: dict | None = None, temp_dir: str | None = None,
                 timeout: float = 120.0):
        self.head = head
        self.num_cpus = num_cpus
        self.resources = dict(resources or {})
        self._own_temp_dir = temp_dir is None
        self.temp_dir = temp_dir or tempfile.mkdtemp(prefix="ray-n-", dir="/tmp")   # short: socket paths
        self.node_id: str | None = None
        self.killed_at: float | None = None
        cmd = [head.ray, "start", "--block", "--address", head.address, "--num-cpus", str(num_cpus),
               "--disable-usage-stats", "--temp-dir", self.temp_dir]
        if self.resources:
            cmd += ["--resources", json.dumps(self.resources)]
        self.log_path = Path(tempfile.mkstemp(prefix="ray-node-", suffix=".log", dir=self.temp_dir)[1])
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=head.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self.node_id = self._wait_raylet(timeout)
            wait_for_nodes(head, alive_ids=[self.node_id], timeout=timeout)
        except BaseException:
            self.stop()
            raise

    def raylet_pid(self) -> int | None:
        """The pid of this node's raylet (a process of our session running `raylet`), or None."""
        for pid in session_members(self.proc.pid):
            args = _cmdline(pid)
            if args and os.path.basename(args[0]) == "raylet":
                return pid
        return None

    def _wait_raylet(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start (worker node) exited with {self.proc.returncode}:\n{self.log()}")
            pid = self.raylet_pid()
            if pid is not None:
                for arg in _cmdline(pid):
                    if arg.startswith("--node_id="):
                        return arg.split("=", 1)[1]
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker node's raylet not running after {timeout:.0f} s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return "(no log)"

    def kill(self, everything: bool = False) -> None:
        """SIGKILL this node's raylet: a lost machine, as the cluster sees it. With everything=True
        every process of the node (raylet, agents, workers, `ray start`) gets SIGKILL at once, so
        nothing of it exits in order."""
        pid = self.raylet_pid()
        if pid is None:
            raise RuntimeError(f"node {self.node_id} has no raylet to kill:\n{self.log()}")
        self.killed_at = time.monotonic()
        targets = session_members(self.proc.pid) if everything else [pid]
        for target in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM to `ray start --block` (it stops what it started); whatever of the node's session
        is still alive afterwards (workers included) gets SIGKILL. Idempotent."""
        from conftest import terminate
        terminate(self.proc)
        deadline = time.monotonic() + 30
        while (left := session_members(self.proc.pid)) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        if not self._log.closed:
            self._log.close()
        if self._own_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "RayNode":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def cluster_nodes(head) -> dict[str, dict]:
    """node id -> {"alive": bool, "is_head": bool, "resources": {...}} as the head's GCS reports
    them, through the state API on the head's dashboard (no driver needed). A node that died stays
    listed, not alive."""
    from ray.util.state import list_nodes
    nodes = list_nodes(address=head.dashboard_url, detail=True, limit=10_000, timeout=30,
                       raise_on_missing_output=False)
    return {n.node_id: {"alive": n.state == "ALIVE", "is_head": bool(n.is_head_node),
                        "resources": dict(n.resources_total or {})} for n in nodes}


def wait_for_nodes(head, alive: int | None = None, alive_ids=(), dead_ids=(), timeout: float = 60.0,
                   poll: float = 0.2) -> dict[str, dict]:
    """Polls `cluster_nodes(head)` until exactly `alive` nodes are alive (if given), every id in
    `alive_ids` is alive and every id in `dead_ids` is reported dead. Returns the last view;
    raises TimeoutError with it after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    alive_ids, dead_ids = set(alive_ids), set(dead_ids)
    nodes: dict[str, dict] = {}
    last_error = None
    while True:
        try:
            nodes = cluster_nodes(head)
            last_error = None
            live = {i for i, n in nodes.items() if n["alive"]}
            if ((alive is None or len(live) == alive) and alive_ids <= live
                    and all(i in nodes and not nodes[i]["alive"] for i in dead_ids)):
                return nodes
        except Exception as err:            # the dashboard may not answer yet: poll again
            last_error = err
        if time.monotonic() > deadline:
            view = {i[:12]: ("alive" if n["alive"] else "dead") for i, n in nodes.items()}
            raise TimeoutError(f"after {timeout:.0f} s: nodes {view}; wanted alive={alive}, alive_ids="
                               f"{sorted(alive_ids)}, dead_ids={sorted(dead_ids)}; last error: {last_error!r}")
        time.sleep(poll)


# ---- a small disk --------------------------------------------------------------------------------
@contextlib.contextmanager
def small_disk(size_mb: int, prefix: str = "small-disk-") -> Iterator[Path]:
    """A fresh directory with a tmpfs of `size_mb` MiB mounted on it (`mount -t tmpfs -o size=...`),
    so writing more than that fails with OSError ENOSPC. Needs root with CAP_SYS_ADMIN (as on this
    dev VM); where the mount fails the test is skipped with mount's own error. Unmounted (lazily if
    still busy) and removed on exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    mount = shutil.which("mount")
    if mount is None:
        path.rmdir()
        pytest.skip("cannot mount a tmpfs: no `mount` command on PATH")
    result = subprocess.run([mount, "-t", "tmpfs", "-o", f"size={int(size_mb)}m,mode=0700", "tmpfs", str(path)],
                            capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        path.rmdir()
        reason = (result.stderr or result.stdout).strip()
        pytest.skip(f"cannot mount a {size_mb} MiB tmpfs (euid {os.geteuid()}): `mount` exited "
                    f"{result.returncode}: {reason}")
    try:
        yield path
    finally:
        umount = subprocess.run(["umount", str(path)], capture_output=True, text=True, timeout=30)
        if umount.returncode != 0:                  # still busy (a file left open): detach it
            subprocess.run(["umount", "-l", str(path)], capture_output=True, text=True, timeout=30)
        with contextlib.suppress(OSError):
            path.rmdir()


def fill_until_full(directory: Path, chunk: int = 1 << 20, limit_mb: int = 1 << 16, name: str | None = None) -> int:
    """Writes zeros to a new file in `directory` (named `name`, else fill-<random>) until the filesystem
    is full, unbuffered, so nothing is left to fail later at close; returns the bytes written before
    ENOSPC. Raises AssertionError if `limit_mb` MiB went in without ENOSPC."""
    written = 0
    name = name or f"fill-{uuid.uuid4().hex[:8]}"
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        block = b"\0" * chunk
        while written < limit_mb << 20:
            try:
                written += os.write(fd, block)
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    return written
                raise
    finally:
        os.close(fd)
    raise AssertionError(f"{written} bytes written to {directory} without ENOSPC")
