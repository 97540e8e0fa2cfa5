"""Linear layers for CPU decoding: our panel kernel (fp32, or bf16 on CPUs with avx512_bf16), else
oneDNN-packed weights.

A speculative round verifies a few tokens per sequence, so the target's linears multiply a weight by
a handful of rows (M = 2..200). On CPU, torch's default `F.linear` (MKL sgemm on a plain weight) is
slow exactly there: measured on this project's 2-core box (fp32, a [8960 x 1536] Qwen MLP weight), five rows
cost 3.6x one row, so verifying 4 draft tokens cost ~2.5 plain steps and ate most of the gain.
Reordering each weight once into oneDNN's blocked layout (torch's own `mkldnn` ops) makes five
rows cost ~1.3x one row, and 40 rows ~2x less than `F.linear` (bench/linear_kernels.py).

Memory: the packed weight replaces the dense one inside the module. Packing reads every dense weight,
so while it runs the checkpoint's memory-mapped pages count in RSS too: peak RSS at load is about
dense + packed, but the dense part is clean file-backed pages the kernel reclaims under pressure, not
anonymous memory (measured, Qwen2.5-1.5B fp32 with the runner's packing, sampled every 20 ms: peak RSS
15.3 GB = anonymous 8.26 GB, which is also its steady state, + file-backed 7.06 GB; 8.38 GB after). A weight shared
with the input embedding (tied lm_head) stays dense for the embedding and is packed once more here, which costs
its size in memory (SmolLM2-135M: 113 MB fp32; Qwen2.5-1.5B: 0.9 GB).

Numerics: a packed linear's rows are as close to `F.linear`'s as `F.linear`'s own rows are to each
other across batch sizes (neither is bitwise batch-invariant; ~1e-6 relative).

Our kernel (csrc/panel_linear.c, fp32, CPUs with a C compiler; the cpu_linear switch under engine.kernels)
goes further at the small M of decoding. oneDNN's packed kernel reads a weight at ~16 GB/s with one
row here, where the memory system gives 30-40: batch-1 decoding is a stream over all the weights, so
that was most of a batch-1 step. The panel layout ([N/16, K, 16]: 16 outputs' weights side by side
for each input index) makes one row a plain forward stream, and the same layout is the B operand
of a register-blocked GEMM for many rows. Measured on SmolLM2's 211 weights on this box
(bench/linear_kernels.py --weights smollm2): 1.2-2.6x oneDNN's speed at 1-24 rows, level at 64 and
2048, 0.82x at 256 (bench/RESULTS.md, "CPU kernels").
It replaces oneDNN's packing where it is used (one copy of each weight, as before).

bf16 models (`models.dtype: auto` on CPUs with avx512_bf16) get the twin, csrc/panel_linear_bf16.c:
pair panels ([N/16, K/2, 16, 2]) and one VDPBF16PS per input pair, so a batch-1 step streams half
the bytes; it builds only where the CPU has the instruction (elsewhere bf16 keeps oneDNN's linears).

Which kernel runs where is measured, not assumed: neither wins everywhere, and where each wins
moves from CPU to CPU (on an Intel Xeon with AMX, oneDNN's bf16 path takes AMX tiles from 16 rows and
beats the panel kernel 3.6x at 64 rows, while the panel kernel is 1.5x faster at 1 to 4 rows).
A `LinearPlan` names the kernel for each row count, and a `PlannedLinear` holds the weight in the
layout of each kernel its plan uses and dispatches every call by its rows. calibrate.py times the
candidates on the machine and writes the plans.

This module knows nothing about the engine: `planned_linears(model, plans, kernel)` (and
`panel_linears` / `pack_linears`, one kernel everywhere) swap modules in place.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .build import choose, load_checked, loaded

SOURCE = Path(__file__).parent / "csrc" / "panel_linear.c"
SOURCE_BF16 = Path(__file__).parent / "csrc" / "panel_linear_bf16.c"     # CPUs with avx512_bf16
SOURCE_AMX = Path(__file__).parent / "csrc" / "amx_linear_bf16.c"        # CPUs with amx_bf16: the same panels
PANEL = 16                                   # outputs per panel (the kernel's NR)



class PackedLinear(nn.Module):
    """`nn.Linear` with its weight reordered once for oneDNN's inner product (CPU only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing is available for this device and dtype (CPU; bf16 needs AVX-512/AVX-NE)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8, dtype=dtype), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N / 16), K, 16]: panel p, row k holds W[16p : 16p + 16, k] (zeros past N)."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // PANEL) * PANEL, k)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def to_pair_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N / 16), ceil(K / 2), 16, 2] (the bf16 kernel's): panel p, pair j holds
    (W[n, 2j], W[n, 2j + 1]) for n = 16p .. 16p + 15 (zeros past N and K)."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // PANEL) * PANEL, -(-k // 2) * 2)
    padded[:n, :k] = weight
    return padded.view(-1, PANEL, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class Flavour:
    """One dtype's kernel: its C source and entry point, its weight layout, and what runs where it
    cannot be used."""
    source: Path
    function: str
    layout: Callable[[torch.Tensor], torch.Tensor]
    instead: str
    needs: tuple[str, ...] = ()      # CPU flags its source's #error checks (build.py: not compiled without)


FLAVOURS = {torch.float32: Flavour(SOURCE, "panel_linear_f32", to_panels, "oneDNN / torch linears"),
            torch.bfloat16: Flavour(SOURCE_BF16, "panel_linear_bf16", to_pair_panels, "oneDNN's bf16 linears",
                                     ("avx512f", "avx512_bf16"))}
# AMX tiles over the bf16 pair panels (csrc/amx_linear_bf16.c): K a multiple of AMX_K
AMX_FLAVOUR = Flavour(SOURCE_AMX, "amx_linear_bf16", to_pair_panels, "the plan without it",
                      ("amx_bf16", "amx_tile", "avx512_bf16"))
AMX_K = 32


class PanelKernel:
    """A loaded panel kernel, fp32 (panel_linear.c) or bf16 (panel_linear_bf16.c).
    `kernel(x, kernel.layout(w), bias, n)` is `F.linear(x, w, bias)` for x [M, K] in its dtype."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32, flavour: Flavour | None = None):
        self.flavour = flavour = flavour or FLAVOURS[dtype]
        self.dtype = dtype
        self.layout = flavour.layout
        self.build = path.stem                          # the source's, compiler's and CPU's build (build.py)
        self._lib = ctypes.CDLL(str(path))
        if flavour is AMX_FLAVOUR and self._lib.amx_enable() != 0:
            raise RuntimeError("the kernel may not use AMX tiles here (arch_prctl ARCH_REQ_XCOMP_PERM refused)")
        fn = getattr(self._lib, flavour.function)
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __deepcopy__(self, memo):                       # one loaded library per process: copies share it
        return self

    def __reduce__(self):                               # another process loads (or builds) its own
        if self.flavour is AMX_FLAVOUR:
            return amx_kernel, ()
        return _loaded, (str(self.dtype).removeprefix("torch."),)

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        m, k = x.shape
        want = self.layout(x.new_zeros(1, k)).shape[1:]                  # the layout's shape for K
        if x.dtype != self.dtype or panels.dtype != self.dtype or tuple(panels.shape[1:]) != want \
                or panels.shape[0] * PANEL < n or (bias is not None and bias.dtype != self.dtype):
            raise ValueError(f"panel linear: x {tuple(x.shape)} {x.dtype} does not fit panels "
                             f"{tuple(panels.shape)} {panels.dtype} (a {self.dtype} kernel)")
        return self.unchecked(x, panels, bias, n)

    def unchecked(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """The call without its shape checks, for a caller that made them once (PanelLinear): a batch-1
        step makes ~200 of these calls, so microseconds each add up."""
        x = x.contiguous()
        m = x.shape[0]
        y = x.new_empty((m, n))
        if m:
            status = self._fn(x.data_ptr(), m, x.shape[1], panels.data_ptr(), None if bias is None else bias.data_ptr(),
                              y.data_ptr(), n, torch.get_num_threads())
            if status:
                raise (MemoryError if status == -1 else ValueError)(f"{self.flavour.function}: status {status} for x "
                                                                    f"{tuple(x.shape)}")
        return y


class PanelLinear(nn.Module):
    """`nn.Linear` with its weight regrouped once into 16-output panels for our kernel (CPU, fp32 or bf16)."""

    def __init__(self, linear: nn.Linear, kernel: PanelKernel):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if weight.dtype != kernel.dtype:
            raise ValueError(f"panel linear: a {weight.dtype} weight for a {kernel.dtype} kernel")
        self.register_buffer("panels", kernel.layout(weight), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().contiguous(), requires_grad=False)
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self._kernel.dtype or x.shape[-1] != self.in_features:
            want = str(self._kernel.dtype).removeprefix("torch.")
            raise ValueError(f"panel linear: expected [..., {self.in_features}] {want}, got {tuple(x.shape)} {x.dtype}")
        y = self._kernel.unchecked(x.reshape(-1, self.in_features), self.panels, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


SELF_CHECK_CASES = ((1, 40, 37, True), (5, 16, 8, False), (13, 33, 600, True), (100, 24, 1030, False))
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}   # bf16: y is rounded once to 8 bits (2^-9)


def check_against_float64(kernel: PanelKernel, cases=SELF_CHECK_CASES, seed: int = 0) -> float:
    """The kernel against float64 `F.linear` on the same (dtype-rounded) inputs: the largest relative
    difference (to the output's largest magnitude) over the cases (M, N, K, with bias)."""
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for m, n, k, bias in cases:
        w = torch.randn(n, k, generator=gen).to(kernel.dtype)
        x = torch.randn(m, k, generator=gen).to(kernel.dtype)
        b = torch.randn(n, generator=gen).to(kernel.dtype) if bias else None
        got = kernel(x, kernel.layout(w), b, n)
        want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        worst = max(worst, ((got.double() - want).abs().max() / want.abs().max()).item())
    return worst


def _self_check(kernel: PanelKernel, cases=SELF_CHECK_CASES) -> None:
    """Ragged M (1 row, one tile, tiles + a remainder), N not a multiple of the panel, odd K, with and
    without bias: within TOLERANCE of float64 `F.linear`."""
    err = check_against_float64(kernel, cases)
    if not err < TOLERANCE[kernel.dtype]:
        raise RuntimeError(f"self-check failed: relative difference {err:.2e} from float64 F.linear")


@lru_cache(maxsize=None)
def _load(dtype: torch.dtype = torch.float32) -> tuple[PanelKernel | None, str | None]:
    flavour = FLAVOURS[dtype]
    return load_checked(flavour.source, lambda path: PanelKernel(path, dtype), _self_check, flavour.instead,
                        needs=flavour.needs)


def _loaded(dtype: str = "float32") -> PanelKernel:
    return policy("on", torch.device("cpu"), getattr(torch, dtype))


# _self_check's cases with K a multiple of AMX_K: one row, rows past one block of 64 and a ragged last tile,
# N not a multiple of the panel, with and without bias
AMX_CHECK_CASES = ((1, 40, 64, True), (5, 16, 32, False), (37, 33, 96, True), (70, 24, 1024, False))


@lru_cache(maxsize=None)
def _load_amx() -> tuple[PanelKernel | None, str | None]:
    return load_checked(SOURCE_AMX, lambda path: PanelKernel(path, torch.bfloat16, AMX_FLAVOUR),
                        lambda kernel: _self_check(kernel, AMX_CHECK_CASES), AMX_FLAVOUR.instead,
                        needs=AMX_FLAVOUR.needs)


def amx_kernel() -> PanelKernel:
    return loaded(_load_amx, "AMX linear kernel")


def amx_unavailable(device: torch.device, weights: dict[str, list[torch.Tensor]]) -> str | None:
    """Why a runner cannot offer the AMX kernel for these weights (family -> [out, in] weights), else None:
    CPUs with amx_bf16, bf16 weights whose inputs are multiples of AMX_K. Builds and checks it on first call."""
    ws = [w for family in weights.values() for w in family]
    if torch.device(device).type != "cpu" or not ws or any(w.dtype != torch.bfloat16 for w in ws):
        return "the AMX kernel is for bf16 weights on CPUs"
    if any(w.shape[1] % AMX_K for w in ws):
        return f"some linear's inputs are not a multiple of {AMX_K}"
    return _load_amx()[1]


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a runner with this device and weight dtype cannot use the panel kernel, else None.
    Builds (or finds) and checks the kernel on first call."""
    if torch.device(device).type != "cpu":
        return f"device {torch.device(device).type}: the kernel is for CPUs"
    if dtype not in FLAVOURS:
        return f"weight dtype {dtype}: the kernel is fp32 or bf16 only"
    return _load(dtype)[1]


def policy(mode: str, device: torch.device, dtype: torch.dtype) -> PanelKernel | None:
    """The panel kernel a runner uses under its switch cpu_linear = mode: auto (where it is available),
    on (raises where not), off (None: oneDNN packing or torch's F.linear)."""
    return choose("cpu_linear", mode, lambda: unavailable(device, dtype), lambda: _load(dtype)[0])


@torch.no_grad()
def _swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every `nn.Linear` of `model` by make(linear), in place. Returns how many."""
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    for name in names:      # one at a time, holding no other dense weight: peak memory + one layer
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(getattr(parent, attr)))
    # Weights loaded from safetensors are views of the checkpoint's memory map; regrouping touched all
    # its pages. Copying the few remaining parameters (embedding, norms) out of the map lets it go,
    # so steady-state memory is the regrouped weights + those copies, not the checkpoint file on top.
    for param in model.parameters():
        param.data = param.data.clone()
    return len(names)


def panel_linears(model: nn.Module, kernel: PanelKernel) -> int:
    """Replace every `nn.Linear` of `model` by a PanelLinear, in place. Returns how many."""
    return _swap_linears(model, lambda linear: PanelLinear(linear, kernel))


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a PackedLinear, in place. Returns how many.
    The caller checks `can_pack` first."""
    return _swap_linears(model, PackedLinear)


PANEL_KIND, AMX, ONEDNN, TORCH = "panel", "amx", "onednn", "torch"
KINDS = (PANEL_KIND, AMX, ONEDNN, TORCH)   # our panel kernel | ours by AMX tiles | oneDNN's packed linear | F.linear
LAYOUT = {PANEL_KIND: "panels", AMX: "panels", ONEDNN: "onednn", TORCH: "dense"}    # the weight copy each reads


@dataclass(frozen=True)
class LinearPlan:
    """The kernel for each row count of one family of linears: `segments` ((last_rows, kind), ...) in
    increasing last_rows; a call of M rows takes the first segment with M <= last_rows, and rows past
    the last segment take its kind."""
    segments: tuple[tuple[int, str], ...]

    def __post_init__(self):
        if not self.segments:
            raise ValueError("a linear plan needs at least one segment")
        limits = [last for last, _ in self.segments]
        if limits != sorted(set(limits)) or any(kind not in KINDS for _, kind in self.segments):
            raise ValueError(f"linear plan: segments must rise and name {KINDS}, got {self.segments}")

    @classmethod
    def single(cls, kind: str) -> "LinearPlan":
        return cls(((1, kind),))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kernels this plan uses, each once, in row order."""
        return tuple(dict.fromkeys(kind for _, kind in self.segments))

    def kind(self, rows: int) -> str:
        for last, kind in self.segments:
            if rows <= last:
                return kind
        return self.segments[-1][1]

    def last_rows(self, kind: str) -> int:
        """The most rows `kind` takes before another kernel does (a large number where it runs to the end)."""
        last = 0
        for i, (limit, k) in enumerate(self.segments):
            if k == kind:
                last = limit if i < len(self.segments) - 1 else 1 << 62
        return last

    def describe(self) -> str:
        """e.g. "panel<=4 onednn" (rows 1-4 our panel kernel, more oneDNN's)."""
        merged: list[list] = []
        for last, kind in self.segments:
            if merged and merged[-1][1] == kind:
                merged[-1][0] = last
            else:
                merged.append([last, kind])
        return " ".join(f"{kind}<={last}" if i < len(merged) - 1 else kind for i, (last, kind) in enumerate(merged))


class PlannedLinear(nn.Module):
    """`nn.Linear` held in the layout of each kernel its `LinearPlan` uses (panels, oneDNN's packed
    weight, the dense weight), each call run by the kernel its row count is planned for. The same
    inputs give each kernel's own numbers (rounding-level apart, like any two linear kernels)."""

    def __init__(self, linear: nn.Linear, plan: LinearPlan, kernel: PanelKernel | None = None,
                 amx: PanelKernel | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.plan = plan
        weight = linear.weight.detach()
        self.weight_dtype = weight.dtype
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().contiguous(), requires_grad=False)
        if AMX in plan.kinds:
            if amx is None or weight.dtype != torch.bfloat16 or self.in_features % AMX_K:
                raise ValueError(f"amx linear: needs the AMX kernel, a bf16 weight and inputs a multiple of {AMX_K}")
            self._amx = amx
        if PANEL_KIND in plan.kinds and (kernel is None or weight.dtype != kernel.dtype):
            raise ValueError(f"panel linear: a {weight.dtype} weight needs a {weight.dtype} panel kernel")
        if PANEL_KIND in plan.kinds or AMX in plan.kinds:        # one copy in pair panels serves both
            self.register_buffer("panels", (kernel or amx).layout(weight), persistent=False)
            self._kernel = kernel
        if ONEDNN in plan.kinds:
            self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight), persistent=False)
        if TORCH in plan.kinds:
            self.weight = nn.Parameter(weight, requires_grad=False)
        self._bind()

    def _bind(self) -> None:
        runs = {PANEL_KIND: self._run_panels, AMX: self._run_amx, ONEDNN: self._run_packed, TORCH: self._run_dense}
        self._limits = [last for last, _ in self.plan.segments[:-1]]
        self._runs = [runs[kind] for _, kind in self.plan.segments]

    def __getstate__(self):
        """Copies and pickles carry oneDNN's packed weight as its dense tensor (its opaque layout has no
        storage to copy) and are packed again on arrival, for the CPU they arrive on."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_runs", "_limits")}
        if "packed_weight" in self._buffers:
            state["_buffers"] = dict(self._buffers, packed_weight=self._buffers["packed_weight"].to_dense())
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if "packed_weight" in self._buffers:
            self._buffers["packed_weight"] = torch.ops.mkldnn._reorder_linear_weight(self._buffers["packed_weight"])
        self._bind()

    def _run_panels(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel.unchecked(x, self.panels, self.bias, self.out_features)

    def _run_amx(self, x: torch.Tensor) -> torch.Tensor:
        return self._amx.unchecked(x, self.panels, self.bias, self.out_features)

    def _run_packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def _run_dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """y for x [M, in_features] in the weight's dtype, no checks (the decoder loop's call)."""
        rows = x.shape[0]
        for limit, run in zip(self._limits, self._runs):
            if rows <= limit:
                return run(x)
        return self._runs[-1](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight_dtype or x.shape[-1] != self.in_features:
            want = str(self.weight_dtype).removeprefix("torch.")
            raise ValueError(f"linear: expected [..., {self.in_features}] {want}, got {tuple(x.shape)} {x.dtype}")
        y = self.run(x.reshape(-1, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"plan={self.plan.describe()!r}")


@dataclass
class MergedPanels:
    """Several planned linears' panels side by side, for one call where their plans take the panel
    kernel (the linears keep views of it: no second copy). Built by `merge_panels`."""
    kernel: PanelKernel
    panels: torch.Tensor
    bias: torch.Tensor | None
    widths: tuple[int, ...]
    last_rows: int              # the most rows the panel kernel takes under the linears' plan

    def covers(self, rows: int) -> bool:
        return rows <= self.last_rows

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.kernel.unchecked(x, self.panels, self.bias, sum(self.widths))
        return tuple(out.split(self.widths, dim=1))


@torch.no_grad()
def merge_panels(linears: list[PlannedLinear]) -> MergedPanels | None:
    """One panel call for `linears` (same input; e.g. q, k and v), or None where they cannot share one:
    no panel layout, unlike plans, widths not multiples of the panel, or bias on some only."""
    plans = {linear.plan for linear in linears}
    biases = [linear.bias for linear in linears]
    if (len(plans) != 1 or PANEL_KIND not in linears[0].plan.kinds or len({b is None for b in biases}) != 1
            or any(linear.out_features % PANEL for linear in linears)):
        return None
    panels = torch.cat([linear.panels for linear in linears])
    at = 0
    for linear in linears:
        count = linear.panels.shape[0]
        linear.panels = panels[at:at + count]
        at += count
    return MergedPanels(linears[0]._kernel, panels, None if biases[0] is None else torch.cat(biases),
                        tuple(linear.out_features for linear in linears), linears[0].plan.last_rows(PANEL_KIND))


FAMILY_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up",
             "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down", "lm_head": "lm_head"}
FAMILIES = ("qkv", "o", "gate_up", "down", "lm_head")


def family(name: str) -> str:
    """The family a linear of this module path belongs to: FAMILIES' by the Llama-style names
    (FAMILY_OF); any other name (Phi's `dense`, GPT-NeoX's `query_key_value`, `fc1`...) is its own
    family, planned and measured apart."""
    last = name.rpartition(".")[2]
    return FAMILY_OF.get(last, last)


def family_weights(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """The weight ([out, in]) of every `nn.Linear` of `model` by family, in module order."""
    weights: dict[str, list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            weights.setdefault(family(name), []).append(module.weight.detach())
    return weights


def planned_linears(model: nn.Module, plans: dict[str, LinearPlan], kernel: PanelKernel | None,
                    amx: PanelKernel | None = None) -> int:
    """Replace every `nn.Linear` of `model` by a PlannedLinear under its family's plan, in place."""
    names = {id(module): name for name, module in model.named_modules() if type(module) is nn.Linear}
    return _swap_linears(model, lambda linear: PlannedLinear(linear, plans[family(names[id(linear)])], kernel, amx))
