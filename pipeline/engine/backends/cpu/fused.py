"""RMSNorm and the gated MLP's SiLU product on CPU, each one pass (csrc/fused_ops.c).

Why: with our linear and attention kernels taking a forward's matmuls, the elementwise ops between
them were what was left, and torch runs each as its own pass over memory. Measured on this project's
2-core AVX-512 box (SmolLM2-135M, fp32, a 2048-token prefill forward): of ~400 ms of torch ops, SiLU
alone took 89 ms and the multiplies 166 ms; RMSNorm is five passes (pow, mean, add, rsqrt, two
multiplies). Here:
  * RMSNorm modules of the model families below become `KernelRMSNorm`: one read of x, one write
    (fp32 and bf16);
  * MLPs, down(silu(gate(x)) * up(x)), become `GateUpMLP`: gate and up are one linear of twice
    the width (one weight stream, one kernel call instead of two), then silu(gate) * up in one pass,
    where that measures faster on the machine than the modules (calibrate.py's MLP form: in bf16 on
    the AMD box the modules won a 2048-token prefill, on the Intel AMX box the merged form).
The new linears are plain `nn.Linear`s, so the runner's linear kernel (ours or oneDNN's) takes them
like any other.

Numerics: fp32 arithmetic, and in bf16 torch's roundings at the same places (the normalised x is
rounded before the product with the weight). What differs
from the Hugging Face modules is the order of one sum (the mean square) and our exponential
(relative error ~1e-7): rounding-level, like our linear kernel's. The kernels are checked against
the Hugging Face modules themselves before first use.

Scope: fp32 and bf16 CPU models of the families in NORMS / MLPS (Llama, SmolLM, Qwen2/2.5, Qwen3,
Mistral) with a SiLU MLP; anything else keeps its modules. Its switch cpu_fused (model/plan.py's Kernels, under engine.kernels) = auto | on | off.

This module knows nothing about the engine: `fuse(model, ops)` swaps modules in place.
"""
from __future__ import annotations

import ctypes
import importlib
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from .build import choose, load_checked, loaded

SOURCE = Path(__file__).parent / "csrc" / "fused_ops.c"
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

# Modules whose forward is exactly the formula the kernels compute (transformers 5.x), by family.
NORMS = ("llama.modeling_llama.LlamaRMSNorm", "qwen2.modeling_qwen2.Qwen2RMSNorm",
         "qwen3.modeling_qwen3.Qwen3RMSNorm", "mistral.modeling_mistral.MistralRMSNorm")
MLPS = ("llama.modeling_llama.LlamaMLP", "qwen2.modeling_qwen2.Qwen2MLP",
        "qwen3.modeling_qwen3.Qwen3MLP", "mistral.modeling_mistral.MistralMLP")


def _classes(names: tuple[str, ...]) -> tuple[type, ...]:
    found = []
    for name in names:
        module, _, cls = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(f"transformers.models.{module}"), cls))
        except (ImportError, AttributeError):          # a transformers release without that family
            continue
    return tuple(found)


FLAGS = ("-ffp-contract=off",)      # no fused multiply-adds: RoPE rounds where torch's ops round (fused_ops.c)


class FusedOps:
    """The loaded kernels: `rms_norm`, `add_rms_norm`, `rope_store` and `silu_mul`, fp32 or bf16."""

    def __init__(self, path: Path):
        self.build = path.stem                          # the source's, compiler's and CPU's build (build.py)
        self._lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._norm, self._add_norm, self._rope = {}, {}, {}
        for dtype, suffix in DTYPES.items():
            norm = getattr(self._lib, f"rms_norm_{suffix}")
            norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
            norm.restype = ctypes.c_int
            self._norm[dtype] = norm
            add_norm = getattr(self._lib, f"add_rms_norm_{suffix}")
            add_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
            add_norm.restype = ctypes.c_int
            self._add_norm[dtype] = add_norm
            rope = getattr(self._lib, f"rope_store_{suffix}")
            rope.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64,
                             ptr, ptr, ptr, ctypes.c_int]
            rope.restype = ctypes.c_int
            self._rope[dtype] = rope
        self._silu = {}
        for dtype, suffix in DTYPES.items():
            silu = getattr(self._lib, f"silu_mul_{suffix}")
            silu.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
            silu.restype = ctypes.c_int
            self._silu[dtype] = silu

    def __deepcopy__(self, memo):                       # one loaded library per process: copies share it
        return self

    def __reduce__(self):                               # another process loads (or builds) its own
        return kernel, ()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., dim] and weight [dim], both fp32 or both bf16: weight * x / sqrt(mean(x^2) + eps)."""
        if x.dtype not in DTYPES or weight.dtype != x.dtype or x.shape[-1] != weight.shape[0]:
            raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype} with weight {tuple(weight.shape)} "
                             f"{weight.dtype}: expected [..., dim] and [dim], both fp32 or both bf16")
        x = x.contiguous()
        y = torch.empty_like(x)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows:
            self._status(self._norm[x.dtype](x.data_ptr(), weight.contiguous().data_ptr(), y.data_ptr(), rows,
                                             x.shape[-1], float(eps), torch.get_num_threads()), "rms_norm")
        return y

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float, check: bool = True) -> torch.Tensor:
        """residual += delta (in place), then rms_norm(residual): a decoder layer's residual add and the
        next norm in one pass. residual and delta [rows, dim] contiguous, weight [dim], one dtype.
        check=False: the caller has made this call's checks on arguments of the same shapes, dtypes
        and strides (the decoder loop, once per forward for all its layers)."""
        if check and (residual.dtype not in DTYPES or delta.dtype != residual.dtype or weight.dtype != residual.dtype
                      or residual.shape != delta.shape or residual.dim() != 2 or residual.shape[1] != weight.shape[0]
                      or not residual.is_contiguous()):
            raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype}, delta "
                             f"{tuple(delta.shape)} {delta.dtype}, weight {tuple(weight.shape)} {weight.dtype}: "
                             "expected contiguous [rows, dim] twice and [dim], one dtype (fp32 or bf16)")
        delta = delta.contiguous()
        y = torch.empty_like(residual)
        if residual.shape[0]:
            self._status(self._add_norm[residual.dtype](
                residual.data_ptr(), delta.data_ptr(), weight.data_ptr(), y.data_ptr(), residual.shape[0],
                residual.shape[1], float(eps), torch.get_num_threads()), "add_rms_norm")
        return y

    def rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   row_table: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                   check: bool = True) -> torch.Tensor:
        """RoPE on the packed new tokens' queries and keys, and the keys and values written to the slot
        store at each token's slot and position (fused_ops.c says how it rounds). q [tokens, heads *
        dim], k and v [tokens, kv_heads * dim] (rows may be strided: column slices of one qkv
        projection), cos / sin [tokens, dim], all one dtype; row_table [4, rows] int64 (slot, start,
        num_new, first packed token); the stores [slots, kv_heads, cap, dim]. Returns the rotated
        queries [tokens, heads, dim] in fp32 (the attention kernel's input). check=False: as add_rms_norm's;
        a row outside the store is still refused (the kernel checks every row)."""
        slots, kv_heads, cap, dim = k_store.shape
        tokens = q.shape[0]
        dtype = q.dtype
        if check and (dtype not in DTYPES or any(t.dtype != dtype for t in (k, v, cos, sin, k_store, v_store)) \
                or q.shape[1] % dim or k.shape != (tokens, kv_heads * dim) or v.shape != k.shape \
                or cos.shape != (tokens, dim) or sin.shape != cos.shape or v_store.shape != k_store.shape \
                or any(t.stride(1) != 1 for t in (q, k, v)) or not all(t.is_contiguous() for t in (
                    cos, sin, row_table, k_store, v_store)) or row_table.dtype != torch.long):
            raise ValueError(f"rope_store: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos "
                             f"{tuple(cos.shape)} ({dtype}) do not fit stores {tuple(k_store.shape)} "
                             f"{k_store.dtype}")
        heads = q.shape[1] // dim
        out = torch.empty((tokens, heads, dim), dtype=torch.float32)
        if tokens:
            status = self._rope[dtype](q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                                       v.stride(0), cos.data_ptr(), sin.data_ptr(), row_table.data_ptr(),
                                       row_table.shape[1], tokens, heads, kv_heads, dim, slots, cap,
                                       out.data_ptr(), k_store.data_ptr(), v_store.data_ptr(),
                                       torch.get_num_threads())
            if status == -3:
                raise ValueError(f"rope_store: a row's slot or positions fall outside the store {tuple(k_store.shape)}")
            if status != 0:
                raise ValueError(f"rope_store: head size {dim} in {dtype}: fp32 takes even sizes, bf16 "
                                 "multiples of 16 up to 512")
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2 * inter] fp32 or bf16 (gate, then up): silu(gate) * up, [..., inter], in one
        pass (bf16: inter a multiple of 8)."""
        if gate_up.dtype not in DTYPES or gate_up.shape[-1] % 2:
            raise ValueError(f"silu_mul: {tuple(gate_up.shape)} {gate_up.dtype}: expected [..., 2 * inter] fp32 or bf16")
        inter = gate_up.shape[-1] // 2
        gate_up = gate_up.contiguous()
        y = gate_up.new_empty((*gate_up.shape[:-1], inter))
        rows = y.numel() // inter if inter else 0
        if rows:
            self._status(self._silu[gate_up.dtype](gate_up.data_ptr(), y.data_ptr(), rows, inter,
                                                   torch.get_num_threads()), "silu_mul")
        return y

    @staticmethod
    def _status(status: int, name: str) -> None:
        if status != 0:
            raise ValueError(f"{name}: bf16 rows must be a multiple of 8 long (kernel status {status})")


class KernelRMSNorm(nn.Module):
    """A Llama-style RMSNorm (weight * x / rms(x)) computed by `FusedOps.rms_norm`."""

    def __init__(self, norm: nn.Module, ops: FusedOps):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self._ops = ops

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class GateUpMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up as one linear ([gate; up] rows) and the product
    by `FusedOps.silu_mul`."""

    def __init__(self, mlp: nn.Module, ops: FusedOps):
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.gate_up_proj = nn.Linear(gate.in_features, gate.out_features + up.out_features,
                                      bias=gate.bias is not None, device=gate.weight.device, dtype=gate.weight.dtype)
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(torch.cat([gate.weight, up.weight]))
            if gate.bias is not None:
                self.gate_up_proj.bias.copy_(torch.cat([gate.bias, up.bias]))
        self.gate_up_proj.requires_grad_(False)
        self.down_proj = mlp.down_proj
        self._ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._ops.silu_mul(self.gate_up_proj(x)))


def _is_silu_mlp(module: nn.Module, mlp_classes: tuple[type, ...]) -> bool:
    """A gated MLP of a known family with SiLU (what GateUpMLP computes), fp32 or bf16, whose gate and up
    are still plain linears (not those of a model another runner has planned already)."""
    from transformers.activations import SiLUActivation
    return type(module) in mlp_classes and isinstance(module.act_fn, (SiLUActivation, nn.SiLU)) \
        and type(module.gate_proj) is nn.Linear and type(module.up_proj) is nn.Linear \
        and module.gate_proj.weight.dtype in DTYPES \
        and (module.gate_proj.bias is None) == (module.up_proj.bias is None) \
        and (module.gate_proj.weight.dtype == torch.float32 or module.gate_proj.out_features % 8 == 0)


@lru_cache(maxsize=None)
def gated_mlp_classes() -> tuple[type, ...]:
    """The families' MLP classes (MLPS), whose forward is down(act(gate(x)) * up(x))."""
    return _classes(MLPS)


def silu_mlps(model: nn.Module) -> list[nn.Module]:
    """The model's MLPs that `fuse` can merge."""
    mlp_classes = gated_mlp_classes()
    return [m for m in model.modules() if _is_silu_mlp(m, mlp_classes)]


@torch.no_grad()
def fuse(model: nn.Module, ops: FusedOps, merge_mlps: bool = True) -> tuple[int, int]:
    """Replace the model's RMSNorms and (merge_mlps) SiLU MLPs of known families (NORMS, MLPS) in
    place by KernelRMSNorm / GateUpMLP. Returns (norms, mlps) replaced. Call before the linears are
    swapped for a kernel's (the new gate/up linear is a plain nn.Linear)."""
    norm_classes, mlp_classes = _classes(NORMS), gated_mlp_classes()
    swaps = []
    for name, module in model.named_modules():
        if type(module) in norm_classes:
            swaps.append((name, KernelRMSNorm(module, ops), "norm"))
        elif merge_mlps and _is_silu_mlp(module, mlp_classes):
            swaps.append((name, None, "mlp"))
    counts = {"norm": 0, "mlp": 0}
    for name, new, kind in swaps:    # MLPs one at a time: peak memory is one layer's gate/up copy
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new if new is not None else GateUpMLP(getattr(parent, attr), ops))
        counts[kind] += 1
    return counts["norm"], counts["mlp"]


SELF_CHECK_SIZES = ((1, 64, 40), (7, 576, 1536), (33, 24, 56))   # (rows, hidden, intermediate)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}          # bf16: one rounding of y (2^-9)


def check_against_modules(ops: FusedOps, sizes=SELF_CHECK_SIZES, seed: int = 0) -> float:
    """The kernels against transformers' own LlamaRMSNorm and LlamaMLP (fp32 and bf16), random
    weights: the largest difference relative to the output's largest magnitude, over its tolerance."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for (rows, hidden, inter), dtype in ((s, d) for s in sizes for d in DTYPES):
        norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
        norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
        x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
        pairs = [(norm(x), KernelRMSNorm(norm, ops)(x))]
        mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu",
                                   num_attention_heads=1, num_key_value_heads=1))
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.weight.data = (torch.randn(lin.weight.shape, generator=gen) / lin.in_features ** 0.5).to(dtype)
        pairs.append((mlp(x), GateUpMLP(mlp, ops)(x)))
        delta = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
        residual = x.clone()
        normed = ops.add_rms_norm(residual, delta, norm.weight, norm.variance_epsilon)
        pairs += [(x + delta, residual), (norm(x + delta), normed)]
        pairs += _rope_pairs(ops, rows, dtype, gen)
        for want, got in pairs:
            err = (got.double() - want.double()).abs().max() / want.double().abs().max()
            worst = max(worst, err.item() / TOLERANCE[dtype])
    return worst


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on packed heads: x [tokens, heads, dim], cos / sin
    [tokens, dim], in x's dtype."""
    from transformers.models.llama.modeling_llama import rotate_half
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def _rope_pairs(ops: FusedOps, tokens: int, dtype: torch.dtype, gen: torch.Generator, heads: int = 6,
                kv_heads: int = 2, dim: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """rope_store on `tokens` tokens in two rows (the second in slot 2 from position 5), q / k / v column
    slices of one projection: (reference, kernel) for the queries, the keys and values stored."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    angle = torch.rand(tokens, dim // 2, generator=gen) * 6.3
    cos, sin = torch.cat([angle.cos()] * 2, 1).to(dtype), torch.cat([angle.sin()] * 2, 1).to(dtype)
    first = tokens // 2
    table = torch.tensor([[0, 2], [0, 5], [first, tokens - first], [0, first]], dtype=torch.long)
    k_store = torch.zeros(3, kv_heads, tokens + 5, dim, dtype=dtype)
    v_store = torch.zeros_like(k_store)
    q_out = ops.rope_store(q, k, v, cos, sin, table, k_store, v_store)
    stored_k = torch.cat([k_store[0, :, :first], k_store[2, :, 5:5 + tokens - first]], 1).transpose(0, 1)
    stored_v = torch.cat([v_store[0, :, :first], v_store[2, :, 5:5 + tokens - first]], 1).transpose(0, 1)
    return [(rope_reference(q.reshape(tokens, heads, dim), cos, sin), q_out),
            (rope_reference(k.reshape(tokens, kv_heads, dim), cos, sin), stored_k),
            (v.reshape(tokens, kv_heads, dim), stored_v)]


def _self_check(ops: FusedOps) -> None:
    err = check_against_modules(ops)
    if not err < 1.0:
        raise RuntimeError(f"self-check failed: {err:.2f}x the tolerance from transformers' modules")


@lru_cache(maxsize=None)
def _load() -> tuple[FusedOps | None, str | None]:
    return load_checked(SOURCE, FusedOps, _self_check, "the models' own modules", FLAGS)


def kernel() -> FusedOps:
    return loaded(_load, "fused CPU kernels")


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a runner with this device and dtype cannot use the kernels, else None (builds and checks
    them on first call)."""
    if torch.device(device).type != "cpu":
        return f"device {torch.device(device).type}: the kernels are for CPUs"
    if dtype not in DTYPES:
        return f"dtype {dtype}: the kernels are fp32 or bf16"
    return _load()[1]


def policy(mode: str, device: torch.device, dtype: torch.dtype) -> FusedOps | None:
    """The kernels a runner uses under its switch cpu_fused = mode: auto (where available), on (raises
    where not), off (None: the models' own modules)."""
    return choose("cpu_fused", mode, lambda: unavailable(device, dtype), kernel)
