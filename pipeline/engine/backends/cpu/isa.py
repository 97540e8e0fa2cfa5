"""The CPU's instruction-set flags, read in one place for every choice that depends on them: the
`auto` dtype (loading/hardware.py), which C kernels are built and with which instructions (build.py),
and the keys of the build and measurement caches (build.py, calibrate.py).

The flags are cpuinfo names (`avx2`, `avx512f`, `avx512_bf16`, `amx_tile`; Arm's `asimd`, `sve`), from
the `flags` (x86) or `Features` (Arm) line of /proc/cpuinfo, else from torch's cpuinfo (other OSes).

SPECPIPE_CPU_FLAGS_OFF names flags to treat as absent: comma-separated, `*` a wildcard
(`avx512*,amx*` is an AVX2-only CPU). The product then plans, picks its dtype and builds its C kernels
as on a CPU without them: the kernels are compiled with the compiler's `-mno-<feature>` for each
masked flag the host has, so no masked instruction runs in our code. Torch's own kernels follow their
own switches (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA); `scripts/test.sh` with SPECPIPE_TEST_CPU sets
all three, so the suite runs as on another kind of CPU.

This module knows nothing about kernels or models and imports no torch on Linux.
"""
from __future__ import annotations

import fnmatch
import os
import platform

MASK_ENV = "SPECPIPE_CPU_FLAGS_OFF"
# cpuinfo name -> GCC/Clang feature, where the two differ by more than the underscores
_COMPILER_NAMES = {"avx_vnni": "avxvnni", "amx_tile": "amx-tile", "amx_bf16": "amx-bf16", "amx_int8": "amx-int8",
                   "amx_fp16": "amx-fp16", "sse4_1": "sse4.1", "sse4_2": "sse4.2"}
_X86_VECTOR = ("avx", "fma", "f16c", "amx")     # flag prefixes a -march=native build may use in our kernels


def proc_cpuinfo_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first `flags` (x86) or `Features` (Arm) line of /proc/cpuinfo, or no flags where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def host_flags() -> frozenset[str]:
    """Every flag this CPU reports, masked or not."""
    found = proc_cpuinfo_flags()
    if found:
        return found
    try:
        import torch
        return frozenset(name for name, on in torch.cpu.get_capabilities().items() if on is True)
    except (ImportError, AttributeError, RuntimeError):
        return frozenset()


def masked(flags: frozenset[str] | None = None) -> frozenset[str]:
    """The flags of `flags` (default: the host's) that SPECPIPE_CPU_FLAGS_OFF names."""
    patterns = [p.strip() for p in os.environ.get(MASK_ENV, "").split(",") if p.strip()]
    flags = host_flags() if flags is None else flags
    return frozenset(f for f in flags if any(fnmatch.fnmatchcase(f, p) for p in patterns))


def cpu_flags() -> frozenset[str]:
    """The flags the product plans with: the host's, less those SPECPIPE_CPU_FLAGS_OFF masks."""
    flags = host_flags()
    return flags - masked(flags)


def lacks(needs: tuple[str, ...]) -> list[str]:
    """Which of the flags `needs` this CPU does not have (or has masked)."""
    have = cpu_flags()
    return [flag for flag in needs if flag not in have]


def compiler_off() -> list[str]:
    """`-mno-<feature>` for each masked x86 vector flag the host has, so a -march=native build leaves
    them out; nothing where no flag is masked or the machine is not x86."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686"):
        return []
    off = [f for f in sorted(masked()) if f.startswith(_X86_VECTOR)]
    return [f"-mno-{_COMPILER_NAMES.get(f, f.replace('_', ''))}" for f in off]
