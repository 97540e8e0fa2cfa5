"""A decoder's forward on CPU as one loop over our kernels (the cpu_decoder switch under engine.kernels).

Why: with the linears, attention, RMSNorms and the MLP's product in our C kernels, what was left of a
step was glue: Hugging Face's module calls (~0.3 ms per layer in Python), RoPE as six torch ops, the
residual adds, and the KV write as two index_puts. On this project's 2-core box (SmolLM2-135M, fp32)
that "rest" measured 12.3 ms of a 35.9 ms batch-1 step and 15.8 of 50.4 ms for 4 rows x 3 tokens
(bench/research/step_split.py). Here each layer is

    h = norm(residual)                      (the previous layer's add and this norm: one pass)
    q, k, v = qkv(h)                        (one panel-kernel call where the plan takes panels: q/k/v's
                                             panels side by side; else three calls)
    q = rope(q); store <- rope(k), v        (one pass: fused_ops.c rope_store)
    a = attention(q, store)                 (slot_attention.c, each row its own keys)
    residual += o(a); h = norm(residual)    (one pass)
    residual += mlp(h)                      (gate/up, silu * up, down: a GateUpMLP's or the family MLP's calls,
                                             gate and up as one panel call where both take panels)

Every linear is a PlannedLinear (linear.py): each call runs the kernel its row count is planned for,
our panel kernel or oneDNN's packed linear (AMX where present) or torch's, so the loop is the same
over any plan.

and a prefill forward (no logits wanted) stops at the last layer's KV write: the rest of that layer
feeds only the logits.

Numbers: the same kernels on the same inputs as the runner's module path, and RoPE and the residual
adds rounding where torch's ops round (fp32 and bf16), so the logits are bitwise those of the model's
own forward through the runner (tests/engine/backends/test_cpu_decoder.py checks it, per family and dtype).

Scope: the families cpu_fused knows (Llama, SmolLM, Qwen2/2.5, Qwen3, Mistral) when the runner has put
our kernels in all the places above (attention, fused norms, planned linears for q/k/v/o) and the model
computes nothing beyond softmax over every key (no soft-cap, sinks or sliding window shorter than the
context served: hf_config.AttentionFeatures). Anything else keeps the model's forward;
`unsupported()` says why. Its switch cpu_decoder (model/plan.py's Kernels, under engine.kernels) = auto | on | off.

This module knows nothing about requests or sampling: it sees the model, the store and a StepLayout.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from pipeline.engine.kv.layout import StepLayout
from pipeline.engine.kv.store import SlotKVCache

from .attention import CpuAttention
from .build import choose
from .fused import FusedOps, GateUpMLP, KernelRMSNorm, gated_mlp_classes
from .linear import MergedPanels, PlannedLinear, merge_panels

# (transformers module, class prefix: <prefix>ForCausalLM / DecoderLayer / Attention, whether q and k are
# RMS-normalised per head before RoPE), per family
FAMILIES = (("llama.modeling_llama", "Llama", False), ("qwen2.modeling_qwen2", "Qwen2", False),
            ("qwen3.modeling_qwen3", "Qwen3", True), ("mistral.modeling_mistral", "Mistral", False))
ROPE_HEAD_MULTIPLE = {torch.float32: 2, torch.bfloat16: 16}       # what fused_ops.c's rope_store takes


@dataclass(frozen=True)
class Family:
    model: type
    layer: type
    attention: type
    qk_norm: bool


def family_of(model: nn.Module) -> Family | None:
    """The family whose causal LM class `model` is (exactly: a subclass may compute something else)."""
    for module, prefix, qk_norm in FAMILIES:
        try:
            mod = importlib.import_module(f"transformers.models.{module}")
            family = Family(getattr(mod, f"{prefix}ForCausalLM"), getattr(mod, f"{prefix}DecoderLayer"),
                            getattr(mod, f"{prefix}Attention"), qk_norm)
        except (ImportError, AttributeError):           # a transformers release without that family
            continue
        if type(model) is family.model:
            return family
    return None


@dataclass
class Norm:
    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module: KernelRMSNorm) -> "Norm":
        return cls(module.weight, module.variance_epsilon)


@dataclass
class Layer:
    input_norm: Norm
    post_norm: Norm
    projections: tuple[PlannedLinear, PlannedLinear, PlannedLinear]    # q, k, v
    qkv: MergedPanels | None        # their panels side by side (the modules hold views of it), or None:
                                    # no panels in their plan, widths not multiples of the panel, or bias on some only
    q_norm: Norm | None             # Qwen3: RMSNorm over each head of q and k before RoPE
    k_norm: Norm | None
    o_proj: PlannedLinear
    mlp: nn.Module                  # called as a module, unless:
    gate_up: PlannedLinear | None   # a GateUpMLP on planned linears: its three kernel calls made here
    down: PlannedLinear | None      # (that, or the gated MLP's below)
    gated: "GatedMLP | None"        # the family's own MLP on planned linears: its calls made here
    scale: float


@dataclass
class GatedMLP:
    """A family's own MLP, down(act(gate(x)) * up(x)), as the calls its forward makes; gate and up in one
    panel call where both are panel-planned alike (their panels side by side: each output column is
    computed as in its own call, so the numbers are the module's)."""
    gate: PlannedLinear
    up: PlannedLinear
    down: PlannedLinear
    act: nn.Module
    gate_up: MergedPanels | None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.gate_up.covers(h.shape[0]):
            g, u = self.gate_up.run(h)
        else:
            g, u = self.gate.run(h), self.up.run(h)
        return self.down.run(self.act(g) * u)

    @classmethod
    def of(cls, mlp: nn.Module) -> "GatedMLP | None":
        """The calls of `mlp` where it is a known family's MLP class (gated_mlp_classes) on planned linears."""
        if type(mlp) not in gated_mlp_classes() or not all(
                type(getattr(mlp, n, None)) is PlannedLinear for n in ("gate_proj", "up_proj", "down_proj")):
            return None
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn, merge_panels([mlp.gate_proj, mlp.up_proj]))


def unsupported(model: nn.Module, attention: CpuAttention | None, ops: FusedOps | None,
                features: str = "") -> str | None:
    """Why this model, with these kernels in place (None: not in use), cannot take the loop, else None.
    features: what the model's attention computes beyond the kernel's softmax over every key (the
    runner's hf_config.AttentionFeatures, described), or ""."""
    if features:
        return f"{type(model).__name__}'s attention has {features}, which our attention kernel does not compute"
    missing = [name for name, k in (("cpu_attention", attention), ("cpu_fused", ops)) if k is None]
    if missing:
        return f"the loop runs on our kernels, and {', '.join(missing)} is not in use"
    family = family_of(model)
    if family is None:
        return f"{type(model).__name__}: the loop knows {', '.join(p for _, p, _ in FAMILIES)} causal LMs"
    norms = [model.model.norm]
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if type(layer) is not family.layer or type(attn) is not family.attention:
            return f"layer {i}: {type(layer).__name__} / {type(attn).__name__}, not the family's own"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [attn.q_norm, attn.k_norm] if family.qk_norm else []
        if not all(type(p) is PlannedLinear for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)):
            return f"layer {i}: the attention's projections are not our planned linears (packed_linear is off)"
        dtype = next(model.parameters()).dtype
        multiple = ROPE_HEAD_MULTIPLE.get(dtype)
        if multiple is None or attn.head_dim % multiple:
            return f"head size {attn.head_dim}: RoPE in {dtype} takes fp32 or bf16, heads a multiple of {multiple}"
    if not all(type(n) is KernelRMSNorm for n in norms):
        return "not every RMSNorm is the fused kernel's"
    return None


class CpuDecoder:
    """The model's forward over the slot store as one loop of kernel calls (`unsupported()` first)."""

    def __init__(self, model: nn.Module, family: Family, cache: SlotKVCache, attention: CpuAttention,
                 ops: FusedOps, reduce: Callable | None = None, gather: Callable | None = None):
        # a tensor-parallel rank's collectives: reduce(x) sums a row-parallel output over the ranks (in
        # place), gather(logits) joins the vocabulary parts on rank 0 (where the LM head is a planned
        # linear; a module LM head gathers in its own forward hook)
        self.reduce, self.gather = reduce or (lambda x: x), gather or (lambda x: x)
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb
        self.final_norm = Norm.of(model.model.norm)
        self.lm_head = model.lm_head
        self.dtype = next(model.parameters()).dtype
        self.cache, self.attention, self.ops = cache, attention, ops
        self.layers = [self._layer(layer, family.qk_norm) for layer in model.model.layers]
        self.merged = sum(layer.qkv is not None for layer in self.layers)     # layers with one qkv call

    @staticmethod
    @torch.no_grad()
    def _layer(layer: nn.Module, qk_norm: bool) -> Layer:
        attn = layer.self_attn
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        mlp = layer.mlp
        planned = (type(mlp) is GateUpMLP and type(mlp.gate_up_proj) is PlannedLinear
                   and type(mlp.down_proj) is PlannedLinear)
        return Layer(input_norm=Norm.of(layer.input_layernorm), post_norm=Norm.of(layer.post_attention_layernorm),
                     projections=projections, qkv=merge_panels(list(projections)),
                     q_norm=Norm.of(attn.q_norm) if qk_norm else None,
                     k_norm=Norm.of(attn.k_norm) if qk_norm else None,
                     o_proj=attn.o_proj, mlp=mlp, gate_up=mlp.gate_up_proj if planned else None,
                     down=mlp.down_proj if planned else None, gated=None if planned else GatedMLP.of(mlp),
                     scale=attn.scaling)

    def _mlp(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        if layer.gate_up is not None:
            return layer.down.run(self.ops.silu_mul(layer.gate_up.run(h)))
        return layer.gated(h) if layer.gated is not None else layer.mlp(h)

    @staticmethod
    def _qkv(layer: Layer, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[tokens, width] each: column slices of one projection where merged and panel-planned."""
        if layer.qkv is not None and layer.qkv.covers(h.shape[0]):
            return layer.qkv.run(h)
        return tuple(p.run(h) for p in layer.projections)

    def _head_norm(self, x: torch.Tensor, norm: Norm, head_dim: int) -> torch.Tensor:
        tokens = x.shape[0]
        return self.ops.rms_norm(x.reshape(tokens, -1, head_dim), norm.weight, norm.eps).view(tokens, -1)

    @torch.inference_mode()
    def forward(self, lay: StepLayout, logits: str) -> torch.Tensor | None:
        """KV for the layout's tokens into the store; logits (model dtype) for every token ("all"), each
        row's last ("last"), or None ("none")."""
        ops, cache = self.ops, self.cache
        positions = lay.flat_position_ids                                     # [1, tokens]
        residual = self.embed(lay.input_ids)[0]                               # [tokens, hidden]
        cos, sin = (t[0] for t in self.rotary(residual, position_ids=positions))
        head_dim = cache.keys[0].shape[-1]
        bits = lay.tree.token_bits if lay.tree is not None else None
        last = len(self.layers) - 1
        h = ops.rms_norm(residual, self.layers[0].input_norm.weight, self.layers[0].input_norm.eps)
        for i, layer in enumerate(self.layers):
            check = i == 0        # the kernels' argument checks: every layer's arguments are alike
            q, k, v = self._qkv(layer, h)
            if layer.q_norm is not None:
                q, k = self._head_norm(q, layer.q_norm, head_dim), self._head_norm(k, layer.k_norm, head_dim)
            q = ops.rope_store(q, k, v, cos, sin, lay.row_table, cache.keys[i], cache.values[i], check)
            if i == last and logits == "none":
                return None                   # the rest of the last layer feeds only the logits
            a = self.attention(q, cache.keys[i], cache.values[i], lay.row_table, layer.scale, bits, check)
            a = self.reduce(layer.o_proj.run(a.to(self.dtype).view(a.shape[0], -1)))
            h = ops.add_rms_norm(residual, a, layer.post_norm.weight, layer.post_norm.eps, check)
            m = self.reduce(self._mlp(layer, h))
            norm = self.layers[i + 1].input_norm if i < last else self.final_norm
            h = ops.add_rms_norm(residual, m, norm.weight, norm.eps, check)
        if logits == "last":
            h = h[lay.row_ends]
        return self.gather(self.lm_head.run(h)) if type(self.lm_head) is PlannedLinear else self.lm_head(h)


def policy(mode: str, model: nn.Module, cache: SlotKVCache, attention: CpuAttention | None,
           ops: FusedOps | None, features: str = "", reduce: Callable | None = None, gather: Callable | None = None) -> CpuDecoder | None:
    """The loop a runner uses under its switch cpu_decoder = mode: auto (where `unsupported` says nothing),
    on (raises with its reason where not), off (None: the model's forward). reduce, gather: a
    tensor-parallel rank's collectives (CpuDecoder)."""
    return choose("cpu_decoder", mode, lambda: unsupported(model, attention, ops, features),
                  lambda: CpuDecoder(model, family_of(model), cache, attention, ops, reduce, gather))
