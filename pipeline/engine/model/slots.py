"""How many sequences run at once when `engine.max_num_seqs` is auto.

Bounded by the KV memory first: every slot of every model holds max_model_len positions of keys and
values, and the stores may take a share of the memory free now. Within that, on CPU, by measurement:
the target's runner times plain decoding steps of 1, 2, 4, ... rows up to that bound (one token each,
at a typical context, so attention reads count) and keeps the fewest rows whose tokens/s reaches
KNEE_SHARE of the best it measured (ModelRunner._fit_slots): more sequences at once past that add
latency and memory for little. The whole range is measured, not stopped at the first flat stretch:
where the linear plan changes kernel (panel to oneDNN at 8-16 rows) a doubling can gain little and
the next one a lot. The rows measured end at the memory bound rounded down (probe_limit), and the rates
are kept in the kernel cache per machine, model and kernels (ModelRunner.measured): the next start
reads those up to its own memory bound. The runner keeps the steps up to the slots kept (`plain_steps`),
which the engine's cost curve takes rather than timing them again. On CUDA the count is BEST (its step
is far from saturation at any batch a store fits).

It knows nothing about requests or drafting.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..config import AUTO
from .hf_config import head_dim, kv_heads, text_config

if TYPE_CHECKING:
    import torch

BEST = {"cpu": 256, "cuda": 256}       # CPU: the most rows the measurement tries; CUDA: the count taken
MEMORY_SHARE = {"cpu": 0.25, "cuda": 0.5}   # of the memory free now, for the KV stores
KNEE_SHARE = 0.9                       # of the best tokens/s measured: the fewest rows that reach it


def most_max_num_seqs(max_num_seqs, device: str) -> int:
    """The most sequences an engine configured with `max_num_seqs` (an integer, or auto) runs on a
    device (cpu | cuda | cuda:N): for sizing work queued ahead of it before it is built."""
    return max_num_seqs if isinstance(max_num_seqs, int) else BEST["cuda" if device.startswith("cuda") else "cpu"]


def slot_bytes(model, max_model_len: int) -> int:
    """KV bytes one slot of `model` needs: keys and values of every layer at max_model_len positions."""
    cfg = text_config(model.config)
    itemsize = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * kv_heads(cfg) * max_model_len * head_dim(cfg) * itemsize


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        import torch
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_max_num_seqs(max_num_seqs, models: list, max_model_len: int) -> tuple[int, str | None]:
    """`engine.max_num_seqs` as a number, and how auto was resolved (None where it was a number): the
    most sequences whose KV fits, each of `models` (the target first, then a draft model beside it)
    keeping one slot per sequence. The one place auto is resolved: the target's runner calls it, and
    on CPU then keeps the fewest of those near its best measured tokens/s (ModelRunner._fit_slots)."""
    if max_num_seqs != AUTO:
        return max_num_seqs, None
    device = next(models[0].parameters()).device
    kind = "cuda" if device.type == "cuda" else "cpu"
    per_seq = sum(slot_bytes(m, max_model_len) for m in models)
    budget = int(free_memory(device) * MEMORY_SHARE[kind])
    fits = max(1, budget // per_seq)
    n = min(BEST[kind], fits)
    why = (f"auto: {per_seq / 2**20:.0f} MiB of KV per sequence, {fits} fit in "
           f"{MEMORY_SHARE[kind]:.0%} of the free {kind} memory; "
           + ("tokens/s measured up to " if kind == "cpu" else "") + f"{BEST[kind]} on {kind}")
    return n, why


def knee(rates: list[tuple[int, float]], share: float = KNEE_SHARE) -> int:
    """The rows to run from (rows, tokens/s) measured: the fewest whose tokens/s reaches `share` of
    the best measured."""
    best = max(rate for _, rate in rates)
    return min(rows for rows, rate in rates if rate >= share * best)


def measuring_context(max_model_len: int) -> int:
    """The context the measuring steps run at: a typical one, so attention's reads count."""
    return min(max_model_len // 2, 384)


def probe_limit(fits: int, step: int = 32) -> int:
    """The most rows to measure where `fits` slots fit in memory: past 2 * step, rounded down to a multiple of
    `step`, so that a start with a little more or less memory free measures (and caches) the same rows."""
    return fits if fits <= 2 * step else fits - fits % step


def probe_rows(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit`, and `limit` itself."""
    rows = [1 << i for i in range(limit.bit_length()) if 1 << i < limit]
    return rows + [limit]
