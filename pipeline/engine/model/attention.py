"""The attention function transformers calls for a model routed through the slot store.

Registered under ATTENTION_NAME (transformers' documented AttentionInterface): with a StepLayout it
attends each row over its own slot's keys, by the layout's kernel (our CPU kernel), FlexAttention's
block tables, or torch's SDPA over rows padded to the longest (split in two when few rows have more
than one new token); without one (e.g. HF `generate` on the same model) it falls through to SDPA.

It knows nothing about requests, drafting or sampling.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..backends.flex import slot_flex_attention
from ..kv.layout import SplitRows

ATTENTION_NAME = "specpipe_slot"


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
    if lay.kernel is not None:
        out = lay.kernel(query[0].transpose(0, 1), key, value, lay.row_table,
                         query.shape[-1] ** -0.5 if scaling is None else scaling,
                         lay.tree.token_bits if lay.tree is not None else None)
        return out.unsqueeze(0), None                                          # [1, num_tokens, heads, dim]
    if lay.flex is not None:
        return slot_flex_attention(query, key, value, lay.token_slot, lay.token_q, lay.flex, max_q, scaling,
                                   lay.tree.token_bits if lay.tree is not None else None), None
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

