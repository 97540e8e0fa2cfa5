"""The backend plan: which kernels run a model's forward on this device, chosen in one place.

`engine.kernels` (auto | torch), `engine.compile` and `engine.cuda_graphs` are what a user decides.
Below them, `Kernels` holds one switch per kernel (auto | on | off): the seams tests and benchmarks
use to force a path; a job never sets them. `choose_backends` turns both into the kernels a runner
loads; the runner applies them to its model and records what runs as a `BackendPlan`, which the job
summary and the benchmarks print. Which linear kernel runs at which row count is not a table here:
under cpu_linear=auto the runner times the candidates on its own weights (backends/cpu/calibrate.py).

It knows nothing about requests, drafting or sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.cpu.attention import AMX_FLAGS, CpuAttention
from ..backends.cpu.attention import policy as cpu_attention_policy
from ..backends.cpu.fused import FusedOps
from ..backends.cpu.fused import policy as cpu_fused_policy
from ..backends.cpu.isa import lacks
from ..backends.cpu.linear import AMX_FLAVOUR, FLAVOURS, LinearPlan, PanelKernel
from ..backends.cpu.linear import policy as cpu_linear_policy
from ..backends.compiled import policy as compiled_layers_policy
from ..backends.cuda.graphs import policy as cuda_graphs_policy
from ..backends.flex import flex_unavailable
from ..config import MODES, EngineConfig


@dataclass(frozen=True)
class Kernels:
    """Per-kernel switches (auto | on | off): test and benchmark seams under `engine.kernels`."""
    packed_linear: bool = True      # CPU: regroup linear weights once for the kernels their plan runs
    cpu_attention: str = "auto"     # our C attention kernel, each row reading its own keys
    cpu_linear: str = "auto"        # with packed_linear: auto (the plan measured here: our panel kernel,
                                    # oneDNN's packed linear, F.linear, by rows) | on (panel kernel) | off (oneDNN)
    linear_plan: LinearPlan | None = None   # with packed_linear: this plan for every family instead
    cpu_fused: str = "auto"         # RMSNorm and silu(gate) * up as one pass each
    cpu_decoder: str = "auto"       # the forward as one loop over the three kernels above
    compiled_layers: str = "auto"   # decoder layers compiled by inductor (backends/compiled.py): auto (on CUDA
                                    # where engine.compile is not off) | on | off
    uncaptured_graphs: bool = False  # the CUDA graphs' padded forward run without capture (CPU tests)
    graph_verify: bool = True       # with graphs: a verify step's logits processing and rule in its graph
                                    # (core/verify_step.py); False: the eager rule after the graph's forward

    @classmethod
    def of(cls, kernels: str) -> "Kernels":
        """engine.kernels: auto (every kernel where it builds and applies) | torch (none of ours)."""
        if kernels == "torch":
            return cls(packed_linear=False, cpu_attention="off", cpu_linear="off", cpu_fused="off",
                       cpu_decoder="off")
        return cls()

    def __post_init__(self):
        for name in ("cpu_attention", "cpu_linear", "cpu_fused", "cpu_decoder", "compiled_layers"):
            if getattr(self, name) not in MODES:
                raise ValueError(f"{name}: expected one of {MODES}, got {getattr(self, name)!r}")
        if (self.cpu_linear == "on" or self.linear_plan is not None) and not self.packed_linear:
            raise ValueError("cpu_linear=on and linear_plan need packed_linear (without it torch's linears run)")


@dataclass
class Backends:
    """The kernels chosen for one model on one device (None: not used)."""
    flex: str | None                 # "always" | "cheaper" (steps where flex.prefer_flex says so) | None
    attention: CpuAttention | None
    linear: PanelKernel | None
    fused: FusedOps | None
    capture_graphs: bool             # capture CUDA graphs
    graphs: bool                     # run the graphs' padded path (captured, or uncaptured in tests)
    compiled_layers: bool = False    # decoder layers compiled (backends/compiled.py)


def flex_policy(compile_mode: str, device: torch.device) -> str | None:
    """When a runner takes the compiled FlexAttention path: "always" (engine.compile=on; raises where
    it cannot compile), "cheaper" (auto: on steps where flex.prefer_flex says so, wherever it can
    compile), or None (off, or auto where it cannot: the eager padded-SDPA path)."""
    if compile_mode not in MODES:
        raise ValueError(f"engine.compile: expected one of {MODES}, got {compile_mode!r}")
    if compile_mode == "off":
        return None
    reason = flex_unavailable(device)
    if reason is not None and compile_mode == "on":
        raise RuntimeError(f"engine.compile=on, but FlexAttention cannot be compiled on {device}: {reason}")
    if reason is not None:
        return None
    return "always" if compile_mode == "on" else "cheaper"


def choose_backends(config: EngineConfig, kernels: Kernels, device: torch.device, dtype: torch.dtype,
                    head_dim: int) -> Backends:
    """The kernels a model of this dtype and head size runs on `device`, loading (building at first
    use) those of ours that apply. Raises where a switch says `on` and its kernel cannot run."""
    capture = not kernels.uncaptured_graphs and cuda_graphs_policy(config.cuda_graphs, device)
    return Backends(
        flex=flex_policy(config.compile, device),
        attention=cpu_attention_policy(kernels.cpu_attention, device, dtype, head_dim),
        linear=cpu_linear_policy(kernels.cpu_linear, device, dtype) if kernels.packed_linear else None,
        fused=cpu_fused_policy(kernels.cpu_fused, device, dtype),
        capture_graphs=capture, graphs=capture or kernels.uncaptured_graphs,
        compiled_layers=compiled_layers_policy(kernels.compiled_layers, config.compile, device))


def cpu_lacks(device: torch.device, dtype: torch.dtype) -> str:
    """Our kernels for a model of this dtype that this CPU has not the instructions for, each with the
    missing flags: checked before any build, so no compiler error is printed at start; "" if none."""
    if device.type != "cpu":
        return ""
    needs = {"panel-linear": FLAVOURS[dtype].needs} if dtype in FLAVOURS else {}
    if dtype == torch.bfloat16:
        needs.update({"amx-linear": AMX_FLAVOUR.needs, "amx-attention": AMX_FLAGS})
    missing = {name: lacks(flags) for name, flags in needs.items()}
    return ", ".join(f"{name} (no {' '.join(flags)})" for name, flags in missing.items() if flags)


@dataclass(frozen=True)
class BackendPlan:
    """What runs one model's forward, as applied."""
    attention: str      # cpu-kernel (with its measured plan: where prompt rows take torch's flash
                        # attention) | flex | flex-where-cheaper | sdpa
    linear: str         # the measured plan per row count (calibrate.py) | panel-<dtype> | onednn-packed |
                        # planned: <plan> (forced) | torch
    norms: str          # fused | modules
    mlp: str            # merged gate/up + silu_mul (with its measurement) | modules
    decoder: str        # cpu-loop | modules
    graphs: str         # captured | uncaptured | off
    layers: str = "modules"   # compiled | modules (the decoder layers, backends/compiled.py)
    cpu_lacks: str = ""       # our kernels for this dtype whose instructions the CPU has not, with the
                              # missing flags (none compiled, so none tried); empty: none missing
    modules_why: str = ""     # on CPU, why the model's own modules run the forward rather than our loop
                              # (cpu_decoder auto): the family or a layer the loop does not compute

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.__dict__.items() if v)
