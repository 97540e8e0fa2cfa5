"""Decoder layers compiled by torch.compile (inductor): a layer's elementwise work fused into few kernels.

Why: on a GPU a small model's step, or any model's at batch 1, is bound by the number of kernels it
runs, not by its weights: an eager Llama layer runs some forty (RMSNorm alone is six: the cast, the
square, the mean, the add, the rsqrt, the two products; RoPE about ten; the residual adds, SiLU and
the product each one), every one a few microseconds even inside a CUDA graph. Compiled, the norms,
RoPE, the residual adds and SiLU x up fuse around the matmuls and attention, which stay library
kernels. The CUDA graphs (backends/cuda/graphs.py) then capture the compiled layers like any other.

  compile_layers   each decoder layer (modules named *DecoderLayer) compiled in place with
                   dynamic shapes (nn.Module.compile), so one compiled graph serves every layer and
                   every step's rows and tokens; compiled on first call. A layer's code is compiled
                   again per kind of step (one row or many, one token or many, attention by lengths or
                   padded, trees), for the target and a draft model of the same family alike: dynamo's
                   limit of variants per code object is raised to RECOMPILES so that none of them runs
                   uncompiled
  a failure        a layer whose compilation or compiled run raises: the runner calls
                   `uncompile_layers` and runs the modules (the KV a failed forward wrote is rewritten
                   with the same values by the rerun)

Numerics: inductor may reorder a reduction (RMSNorm's mean square) or fuse a cast: rounding-level
differences, as between any two kernels for the same formula.

This module knows nothing about the engine: it sees a model.
"""
from __future__ import annotations

import torch
from torch import nn

from .flex import flex_unavailable


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


RECOMPILES = 64


def compile_layers(model: nn.Module) -> int:
    """Compile every decoder layer in place; returns how many."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILES)
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def uncompile_layers(model: nn.Module) -> None:
    """Back to the modules' own forward."""
    for layer in decoder_layers(model):
        layer._compiled_call_impl = None


def unavailable(device: torch.device) -> str | None:
    """Why layers cannot be compiled for `device`, or None: inductor's needs, as FlexAttention's (a C++
    compiler on CPU, Triton on CUDA)."""
    return flex_unavailable(device)


def policy(mode: str, compile_mode: str, device: torch.device) -> bool:
    """Whether a runner compiles its layers: auto (on CUDA, where engine.compile is not off and inductor
    can compile), on (raises where it cannot), off."""
    if mode == "off":
        return False
    reason = unavailable(device)
    if mode == "on":
        if reason is not None:
            raise RuntimeError(f"compiled_layers=on, but layers cannot be compiled on {device}: {reason}")
        return True
    return device.type == "cuda" and compile_mode != "off" and reason is None
