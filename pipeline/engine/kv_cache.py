"""Slot KV cache: one preallocated store per model, a per-sequence length, rollback by moving it.

Each model (target, draft) gets one buffer per layer of shape [num_slots, kv_heads, max_len,
head_dim]. A running sequence owns one slot; its *computed* length (how many of its positions have
KV) lives in the engine's bookkeeping, not here. Rolling back rejected draft positions is only a
smaller length next round: the stale KV beyond it is masked out and later overwritten. Nothing is
copied or re-padded per round.

Hugging Face decoder models are routed through this store with transformers' documented extension
points: a `Cache` subclass whose `update` writes at per-sequence positions, and an attention
function registered under ATTENTION_NAME that reads the per-sequence mask. Tokens travel packed
([1, num_tokens]) through the model, so projections and MLPs never compute padding; only attention
unpacks them into rows.

This module knows nothing about requests, drafting or sampling: the engine hands it a StepLayout
(which slots, where each sequence starts, how many new tokens each has) before every forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .cpu_attention import CpuAttention
from .flex import BLOCK, block_tables, slot_flex_attention

ATTENTION_NAME = "specpipe_slot"


@dataclass
class SplitRows:
    """Padded attention split in two (slot_attention): every row's first new token over the batch's
    keys, then the other tokens of the few rows that have more ([multi, max_q - 1] padded) over
    those rows' keys only. A step where most sequences run g = 0 and a few draft then costs what its
    tokens cost, not every row padded to the longest draft (measured: one drafting row of 5 tokens
    among 47 of 1 made the padded step 22% slower, bench/step_bench.py --first-q 5)."""
    row_starts: torch.Tensor   # [batch] packed index of each row's first token
    multi: torch.Tensor        # [multi] rows with more than one new token
    rest_tokens: torch.Tensor  # [rest] packed index of each token past its row's first
    rest_row: torch.Tensor     # [rest] its row's index in `multi`
    rest_q: torch.Tensor       # [rest] its index within the row, minus one
    kv_len: int                # keys read by the multi rows: max over them of start + num_new


@dataclass
class StepLayout:
    """Where one forward's tokens go. The model sees them packed flat ([1, num_tokens]: no padding in
    the projections and MLPs); attention unpacks them into padded [batch, max_q] rows. Every tensor
    is a view of one buffer copied to the device once per forward (make_layout)."""
    input_ids: torch.Tensor    # [1, num_tokens] int64 the tokens, packed row after row
    slots: torch.Tensor        # [batch] int64 slot of each row
    row_table: torch.Tensor    # [4, batch] int64 slot, start, number of new tokens, first packed token
    row_ends: torch.Tensor     # [batch] int64 packed index of each row's last token
    position_ids: torch.Tensor  # [batch, max_q] int64 RoPE positions (padding repeats the last real one)
    is_valid: torch.Tensor     # [batch, max_q] bool real token (not padding)
    token_row: torch.Tensor    # [num_tokens] int64 row of each packed token
    token_q: torch.Tensor      # [num_tokens] int64 index of each packed token within its row
    kv_len: int                # keys read per row: max over rows of start + num_new
    slot_range: tuple[int, int] | None  # (lo, hi) when slots == arange(lo, hi): read a view, not a gather
    flex: tuple[torch.Tensor, ...] | None = None  # block tables (flex.block_tables): attention over the
                                                  # whole store, each row reading its own blocks only
    split: SplitRows | None = None  # the padded path's split when few rows have more than one token
    rest_mask: torch.Tensor | None = None  # the split's second mask (attention_masks), set by the runner
    cpu_kernel: CpuAttention | None = None  # the CPU kernel (cpu_attention.py) reads the whole store,
                                            # each row its own keys: no padding, no mask, no split

    @property
    def token_slot(self) -> torch.Tensor:               # [num_tokens] slot of each packed token
        return self.slots[self.token_row]

    @property
    def flat_position_ids(self) -> torch.Tensor:        # [1, num_tokens]
        return self.position_ids[self.token_row, self.token_q].unsqueeze(0)


def make_layout(slots: list[int], starts: list[int], tokens: list[list[int]], device: torch.device,
                flex_store: tuple[int, int] | None = None, cpu_kernel: CpuAttention | None = None) -> StepLayout:
    """The layout for rows of new tokens tokens[b] at positions starts[b]... in slots[b], built on
    the host as plain ints and copied to the device in one transfer (a GPU step is otherwise a string
    of tiny copies). flex_store: (num_slots, capacity) of the store when attention takes the
    FlexAttention path (its block tables are then built on the device, flex.block_tables); cpu_kernel:
    the CPU kernel that attends instead of the padded path (at most one of the two)."""
    num_new = [len(t) for t in tokens]
    batch, max_q, num_tokens = len(slots), max(num_new), sum(num_new)
    ends, end = [], -1
    for n in num_new:
        end += n
        ends.append(end)
    firsts = [e - n + 1 for e, n in zip(ends, num_new)]                   # packed index of each row's first token
    multi = [b for b, n in enumerate(num_new) if n > 1]
    split = flex_store is None and cpu_kernel is None and multi and 2 * len(multi) <= batch   # see SplitRows
    split_ids = (multi
                 + [e - n + 1 + q for m in multi for e, n in [(ends[m], num_new[m])] for q in range(1, n)]
                 + [i for i, m in enumerate(multi) for _ in range(1, num_new[m])]
                 + [q - 1 for m in multi for q in range(1, num_new[m])]) if split else []
    host = torch.tensor(
        [t for row in tokens for t in row] + slots + starts + num_new + firsts + ends
        + [s + min(q, n - 1) for s, n in zip(starts, num_new) for q in range(max_q)]
        + [int(q < n) for n in num_new for q in range(max_q)]
        + [r for r, n in enumerate(num_new) for _ in range(n)]
        + [q for n in num_new for q in range(n)] + split_ids, dtype=torch.long)
    rest = num_tokens - batch
    (input_ids, row_table, ends_t, position_ids, is_valid, token_row, token_q,
     *split_t) = host.to(device).split([num_tokens, 4 * batch, batch] + [batch * max_q] * 2 + [num_tokens] * 2
                                       + ([len(multi)] + [rest] * 3 if split else []))
    row_table = row_table.view(4, batch)
    slots_t, starts_t, num_new_t = row_table[0], row_table[1], row_table[2]
    flex_tables = None
    if flex_store is not None:
        num_slots, cap = flex_store
        flex_tables = block_tables(slots_t, starts_t, num_new_t, num_slots, max_q, cap // BLOCK)
    contiguous = slots == list(range(slots[0], slots[0] + batch))
    return StepLayout(
        input_ids=input_ids.unsqueeze(0), slots=slots_t, row_table=row_table, row_ends=ends_t,
        position_ids=position_ids.view(batch, max_q), is_valid=is_valid.view(batch, max_q).bool(),
        token_row=token_row, token_q=token_q,
        kv_len=max(s + n for s, n in zip(starts, num_new)),
        slot_range=(slots[0], slots[0] + batch) if contiguous else None,
        flex=flex_tables,
        split=SplitRows(row_table[3], *split_t, kv_len=max(starts[m] + num_new[m] for m in multi)) if split else None,
        cpu_kernel=cpu_kernel,
    )


def attention_masks(layout: StepLayout, num_groups: int, dtype: torch.dtype,
                    sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The padded path's additive masks: (the one transformers hands every layer as attention_mask,
    the split's second or None). Row (b, q) sees keys 0..position(b, q); query heads sharing a KV head
    are folded into the query axis (see slot_attention). Unsplit: [batch, 1, num_groups * max_q,
    kv_len]. Split: [batch, 1, num_groups, kv_len] for every row's first token, and [multi, 1,
    num_groups * (max_q - 1), split.kv_len] for the rest."""
    split = layout.split
    if split is None:
        return _mask(layout.position_ids, layout.kv_len, num_groups, dtype, sliding_window), None
    return (_mask(layout.position_ids[:, :1], layout.kv_len, num_groups, dtype, sliding_window),
            _mask(layout.position_ids[split.multi, 1:], split.kv_len, num_groups, dtype, sliding_window))


def _mask(position_ids: torch.Tensor, kv_len: int, num_groups: int, dtype: torch.dtype,
          sliding_window: int | None) -> torch.Tensor:
    keys = torch.arange(kv_len, device=position_ids.device)                    # [kv_len]
    pos = position_ids.unsqueeze(-1)                                           # [rows, q, 1]
    allowed = keys <= pos                                                      # [rows, q, kv_len]
    if sliding_window is not None:
        allowed &= keys > pos - sliding_window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    rows, q, _ = mask.shape
    return mask.unsqueeze(1).expand(rows, num_groups, q, kv_len).reshape(rows, 1, num_groups * q, kv_len)


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
        """KV positions [0, n) of slot `src` into slot `dst`, every layer (prefix reuse, prefix.py)."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, :n].copy_(buf[src, :, :n])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write packed key/value [1, kv_heads, num_tokens, head_dim] at each token's slot and position;
        return the keys and values each row attends to: [batch, kv_heads, kv_len, head_dim]."""
        lay = self.layout
        slot_t = lay.slots[lay.token_row]                                      # [num_tokens]
        pos_t = lay.position_ids[lay.token_row, lay.token_q]                   # [num_tokens]
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        k_buf[slot_t, :, pos_t] = key_states[0].transpose(0, 1).to(k_buf.dtype)   # [num_tokens, kv_heads, dim]
        v_buf[slot_t, :, pos_t] = value_states[0].transpose(0, 1).to(v_buf.dtype)
        if lay.flex is not None or lay.cpu_kernel is not None:                 # each row reads its own keys
            return k_buf, v_buf
        if lay.slot_range is not None:
            lo, hi = lay.slot_range
            return k_buf[lo:hi, :, :lay.kv_len], v_buf[lo:hi, :, :lay.kv_len]
        return k_buf[lay.slots, :, :lay.kv_len], v_buf[lay.slots, :, :lay.kv_len]

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over the slot store. query packed [1, heads, num_tokens, head_dim]; key/value
    [batch, kv_heads, kv_len, head_dim]; attention_mask from `attention_masks()` above (the split's
    second in layout.rest_mask). Returns the packed output [1, num_tokens, heads, head_dim].
    Calls without `slot_layout` (e.g. HF `generate` on the same model) fall through to SDPA."""
    lay = kwargs.get("slot_layout")
    if lay is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    batch, max_q = lay.is_valid.shape
    if lay.cpu_kernel is not None:
        out = lay.cpu_kernel(query[0].transpose(0, 1), key, value, lay.row_table,
                             query.shape[-1] ** -0.5 if scaling is None else scaling)
        return out.unsqueeze(0), None                                          # [1, num_tokens, heads, dim]
    if lay.flex is not None:
        return slot_flex_attention(query, key, value, lay.token_slot, lay.token_q, lay.flex, max_q, scaling), None
    if lay.split is not None:
        return _split_attention(query, key, value, (attention_mask, lay.rest_mask), lay.split, max_q, scaling), None
    tokens = query[0].transpose(0, 1)                                          # [num_tokens, heads, dim]
    padded = tokens.new_zeros(batch, max_q, *tokens.shape[1:])                 # unpack into rows
    padded[lay.token_row, lay.token_q] = tokens
    out = _attend_rows(padded, key, value, attention_mask, scaling)
    return out[lay.token_row, lay.token_q].unsqueeze(0), None                # [1, num_tokens, heads, dim]


def _attend_rows(padded: torch.Tensor, key, value, mask, scaling) -> torch.Tensor:
    """Masked attention for padded query rows [rows, q, heads, dim] over key/value [rows, kv_heads,
    kv_len, dim]. Returns [rows, q, heads, dim]."""
    rows, q_len, num_heads, head_dim = padded.shape
    num_kv_heads = key.shape[1]
    groups = num_heads // num_kv_heads
    # Fold the query heads sharing a KV head into the query axis: no K/V repeat (CPU SDPA ignores enable_gqa).
    q = padded.permute(0, 2, 1, 3).reshape(rows, num_kv_heads, groups * q_len, head_dim)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(rows, num_heads, q_len, head_dim).permute(0, 2, 1, 3)


def _split_attention(query, key, value, masks, split: SplitRows, max_q: int, scaling) -> torch.Tensor:
    """SplitRows' two padded attentions: [batch, 1] first tokens over every row's keys (the cache's
    view when slots are contiguous), [multi, max_q - 1] other tokens over the multi rows' keys only."""
    tokens = query[0].transpose(0, 1)                                          # [num_tokens, heads, dim]
    out = torch.empty_like(tokens)
    out[split.row_starts] = _attend_rows(tokens[split.row_starts].unsqueeze(1), key, value, masks[0], scaling)[:, 0]
    rest = tokens.new_zeros(split.multi.shape[0], max_q - 1, *tokens.shape[1:])
    rest[split.rest_row, split.rest_q] = tokens[split.rest_tokens]
    out[split.rest_tokens] = _attend_rows(rest, key[split.multi, :, :split.kv_len], value[split.multi, :, :split.kv_len],
                                          masks[1], scaling)[split.rest_row, split.rest_q]
    return out.unsqueeze(0)                                                    # [1, num_tokens, heads, dim]


def register_attention() -> None:
    """Register the slot attention (and SDPA's mask builder for non-slot calls). Idempotent."""
    AttentionInterface.register(ATTENTION_NAME, slot_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
