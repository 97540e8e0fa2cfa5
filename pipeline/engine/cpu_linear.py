"""oneDNN-packed linear layers for CPU decoding.

A speculative round verifies a few tokens per sequence, so the target's linears multiply a weight by
a handful of rows (M = 2..200). On CPU, torch's default `F.linear` (MKL sgemm on a plain weight) is
slow exactly there: measured on this project's 2-core box (fp32, a [8960 x 1536] Qwen MLP weight), five rows
cost 3.6x one row, so verifying 4 draft tokens cost ~2.5 plain steps and ate most of the gain.
Reordering each weight once into oneDNN's blocked layout (torch's own `mkldnn` ops) makes five
rows cost ~1.3x one row, and 40 rows ~2x less than `F.linear` (bench/linear_kernels.py).

Memory: the packed weight replaces the dense one inside the module. Packing reads every dense weight,
so while it runs the checkpoint's memory-mapped pages count in RSS too: peak RSS at load is about
dense + packed (measured: Qwen2.5-1.5B fp32 12.3 GB at the peak, 7.3 GB after). A weight shared
with the input embedding (tied lm_head) stays dense for the embedding and is packed once more here, which costs
its size in memory (SmolLM2-135M: 113 MB fp32; Qwen2.5-1.5B: 0.9 GB).

Numerics: a packed linear's rows are as close to `F.linear`'s as `F.linear`'s own rows are to each
other across batch sizes (neither is bitwise batch-invariant; ~1e-6 relative).

This module knows nothing about the engine: `pack_linears(model)` swaps modules in place.
"""
from __future__ import annotations

import torch
from torch import nn


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


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a PackedLinear, in place. Returns how many.
    The caller checks `can_pack` first."""
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    for name in names:      # one at a time, holding no other dense weight: peak memory + one layer
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(getattr(parent, attr)))
    # Weights loaded from safetensors are views of the checkpoint's memory map; packing touched all
    # its pages. Copying the few remaining parameters (embedding, norms) out of the map lets it go,
    # so steady-state memory is the packed weights + those copies, not the checkpoint file on top.
    for param in model.parameters():
        param.data = param.data.clone()
    return len(names)
