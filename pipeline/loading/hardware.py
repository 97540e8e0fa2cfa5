"""Which compute dtype a model runs in on the hardware it is loaded on (`models.dtype: auto`).

`auto` picks bfloat16 where bf16 matmuls are fast and float32 elsewhere:
  - CUDA: bfloat16 when the GPU has native bf16 (compute capability 8.0+, or ROCm), else float16.
    Emulated bf16 (`torch.cuda.is_bf16_supported()`'s default) does not count: it is slow.
  - CPU: bfloat16 when the CPU has bf16 dot-product instructions, `avx512_bf16` (Cooper Lake, Zen 4+)
    or AMX (`amx_bf16`, Sapphire Rapids+); else float32. Plain AVX-512 or AVX2 without them
    converts bf16 in software: bf16 matmuls measured ~5x slower than fp32 on an AVX2 EPYC.
The CPU flags are the product's one reading of them (engine/backends/cpu/isa.py: /proc/cpuinfo, else
torch's cpuinfo; SPECPIPE_CPU_FLAGS_OFF masks flags). Not used, on purpose: `torch.ops.mkldnn.
_is_mkldnn_bf16_supported()` is also true for plain AVX-512 (oneDNN can emulate bf16 there), and
`torch.backends.cpu.get_cpu_capability()` names only the vector width (AVX2/AVX512).

The resolution runs where the model is loaded (the worker), so each machine decides for itself; the
config keeps `auto` (and the config hash with it). This module knows nothing about models or configs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ..engine.backends.cpu.isa import cpu_flags

AUTO = "auto"
EXPLICIT_DTYPES = ("float32", "bfloat16", "float16")
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")     # in order of preference when naming the reason


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str      # one of EXPLICIT_DTYPES
    reason: str     # "configured", or why `auto` chose it, e.g. "auto: avx512_bf16"

    def describe(self) -> str:
        return f"{self.dtype} ({self.reason})"


def cuda_has_bf16(device: str) -> bool:
    """Native bf16 on this CUDA/ROCm device (not the emulated path)."""
    import torch
    with torch.cuda.device(torch.device(device)):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_dtype(name: str, device: str, flags: Callable[[], Iterable[str]] = cpu_flags,
                  cuda_bf16: Callable[[str], bool] = cuda_has_bf16) -> DtypeChoice:
    """The dtype to load a model in on `device` for the configured `name` (explicit or `auto`).
    `flags` and `cuda_bf16` are the hardware probes (injectable for tests)."""
    if name in EXPLICIT_DTYPES:
        return DtypeChoice(name, "configured")
    if name != AUTO:
        raise ValueError(f"dtype must be {AUTO!r} or one of {list(EXPLICIT_DTYPES)}, got {name!r}")
    if device.startswith("cuda"):
        if cuda_bf16(device):
            return DtypeChoice("bfloat16", "auto: GPU has native bf16")
        return DtypeChoice("float16", "auto: GPU lacks native bf16")
    present = set(flags())
    found = [flag for flag in CPU_BF16_FLAGS if flag in present]
    if found:
        return DtypeChoice("bfloat16", f"auto: {found[0]}")
    return DtypeChoice("float32", "auto: CPU has no avx512_bf16/amx_bf16")
