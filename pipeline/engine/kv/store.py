"""SlotKVCache: one preallocated KV store per model; rollback is a length.

Each model (target, draft) gets one buffer per layer of shape [num_slots, kv_heads, max_len,
head_dim]. A running sequence owns one slot; its *computed* length (how many of its positions have
KV) lives in the engine's bookkeeping, not here. Rolling back rejected draft positions is only a
smaller length next round: the stale KV beyond it is masked out and later overwritten. Nothing is
copied or re-padded per round.

It is the `Cache` transformers' models write through (`update` at per-sequence positions, from the
StepLayout set before each forward). It knows nothing about requests, drafting, sampling or which
kernel attends.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .layout import StepLayout


class SlotKVCache(Cache):
    """Preallocated per-slot KV store for one model. Set `layout` before each forward."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__(layers=[])
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        # zeros, not empty: masked positions still enter the weighted sum (0 * NaN would be NaN)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_layers, self.num_slots, self.max_len = num_layers, num_slots, max_len
        self.layout: StepLayout | None = None

    # Attributes transformers' mask helpers read from any Cache.
    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_compileable(self) -> bool:
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def copy_positions(self, src: int, dst: int, n: int) -> None:
        """KV positions [0, n) of slot `src` into slot `dst`, every layer (prefix reuse, core/prefix.py)."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, :n].copy_(buf[src, :, :n])

    def move_positions(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV of position src[i] of slot slots[i] to position dst[i] of the same slot, every layer: a
        token tree's accepted path made contiguous (one gather of every source, then the writes, so a
        destination that is another move's source is read before it is overwritten)."""
        for buf in (*self.keys, *self.values):
            buf[slots, :, dst] = buf[slots, :, src]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write packed key/value [1, kv_heads, num_tokens, head_dim] at each token's slot and position;
        return the keys and values each row attends to: [batch, kv_heads, kv_len, head_dim]."""
        lay = self.layout
        slot_t = lay.slots[lay.token_row]                                      # [num_tokens]
        pos_t = lay.token_write_pos                                            # [num_tokens]
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        if key_states.shape[1] != k_buf.shape[1] or key_states.shape[-1] != k_buf.shape[-1]:
            raise ValueError(f"layer {layer_idx} writes keys of {key_states.shape[1]} heads x {key_states.shape[-1]}, "
                             f"but its config sizes the store for {k_buf.shape[1]} x {k_buf.shape[-1]}: the "
                             f"model's attention does not match its config")
        k_buf[slot_t, :, pos_t] = key_states[0].transpose(0, 1).to(k_buf.dtype)   # [num_tokens, kv_heads, dim]
        v_buf[slot_t, :, pos_t] = value_states[0].transpose(0, 1).to(v_buf.dtype)
        if lay.flex is not None or lay.kernel is not None:                 # each row reads its own keys
            return k_buf, v_buf
        if lay.slot_range is not None:
            lo, hi = lay.slot_range
            return k_buf[lo:hi, :, :lay.kv_len], v_buf[lo:hi, :, :lay.kv_len]
        return k_buf[lay.slots, :, :lay.kv_len], v_buf[lay.slots, :, :lay.kv_len]

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

