"""Building our C kernels (csrc/*.c) for the CPU this process runs on.

Each kernel is one C file, built with the system C compiler the first time a runner asks for it
(about a second): -O3, the host's own vector instructions (-march=native, less those isa.py masks),
OpenMP (torch's runtime is the one loaded). The shared library is cached under SPECPIPE_KERNEL_CACHE
(default ~/.cache/specpipe/kernels), keyed by the source (and the headers beside it), the compiler and
the CPU's instruction-set flags (isa.py), so a home directory shared by unlike machines gets one build
per kind, and a source edit rebuilds.
Concurrent workers may build the same file: the last atomic rename wins, with identical content.

The kernels' modules (attention.py, linear.py, fused.py) load the library with ctypes and check it
against a torch reference before first use.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

from pipeline.engine.config import MODES

from .isa import compiler_off, cpu_flags, lacks

K = TypeVar("K")
CPU_LACKS = "this CPU lacks"     # how a kernel's reason starts where the CPU has not its instructions
log = logging.getLogger(__name__)


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _arch_flags() -> list[str]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        return ["-march=native", *compiler_off()]      # less any instructions SPECPIPE_CPU_FLAGS_OFF masks
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


def cache_dir() -> Path:
    root = os.environ.get("SPECPIPE_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specpipe", "kernels")
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:                                   # read-only home (some containers): a private temp dir
        return Path(tempfile.mkdtemp(prefix="specpipe-kernels-"))


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library for this C source, compiler and CPU: built once, then reused. extra_flags:
    a kernel's own (e.g. -ffp-contract=off where its numbers must round where torch's do)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler on PATH (cc, gcc or clang; or set CC)")
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", *_arch_flags(), *extra_flags]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]    # what the source may include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, cc, version, *flags,
                                    " ".join(sorted(cpu_flags())), platform.machine()]).encode()).hexdigest()[:16]
    cache = cache_dir()
    lib = cache / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, str(source), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, lib)                          # atomic: concurrent workers build the same file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load_checked(source: Path, wrap: Callable[[Path], K], check: Callable[[K], None],
                 instead: str, extra_flags: tuple[str, ...] = (),
                 needs: tuple[str, ...] = ()) -> tuple[K | None, str | None]:
    """Build (or find) the library for `source`, wrap it and check it against its reference:
    (kernel, None), or (None, why) on any failure, logged with what runs `instead`. `needs`: the CPU
    flags the source requires; where some are missing nothing is compiled and nothing logged, the
    reason is `CPU_LACKS` and the flags (the runner's plan line names the kernels left out)."""
    missing = lacks(needs)
    if missing:
        return None, f"{CPU_LACKS} {', '.join(missing)}"
    try:
        kernel = wrap(build(source, extra_flags))
        check(kernel)
        return kernel, None
    except Exception as e:                               # noqa: BLE001 - any failure: the caller falls back
        log.warning("%s kernel unavailable, %s instead: %s: %s", source.stem, instead, type(e).__name__, e)
        return None, f"{type(e).__name__}: {e}"


def loaded(load: Callable[[], tuple[K | None, str | None]], what: str) -> K:
    """The kernel `load()` (a load_checked) gives, or a RuntimeError naming `what` and why not."""
    kernel, reason = load()
    if kernel is None:
        raise RuntimeError(f"{what} unavailable: {reason}")
    return kernel


def choose(key: str, mode: str, why_not: Callable[[], str | None], load: Callable[[], K]) -> K | None:
    """A kernel under its switch `key` = mode (model/plan.py's Kernels): auto (where `why_not()` says
    nothing), on (raises with its reason where not), off (None: the caller's torch/oneDNN path)."""
    if mode not in MODES:
        raise ValueError(f"{key}: expected one of {MODES}, got {mode!r}")
    if mode == "off":
        return None
    reason = why_not()
    if reason is not None:
        if mode == "on":
            raise RuntimeError(f"{key}=on, but the kernel cannot be used: {reason}")
        return None
    return load()
