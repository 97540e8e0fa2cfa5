"""The attention function transformers calls for a model routed through the slot store.

Registered under ATTENTION_NAME (transformers' documented AttentionInterface): with a StepLayout it
attends each row over its own slot's keys, by the layout's kernel (our CPU kernel), FlexAttention's
block tables, or torch's SDPA over rows padded to the longest (split in two when few rows have more
than one new token); without one (e.g. HF `generate` on the same model) it falls through to SDPA.

It knows nothing about requests, drafting or sampling.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..backends.flex import slot_flex_attention
from ..kv.layout import SplitRows

ATTENTION_NAME = "specpipe_slot"
# The layout of the forward under way (`attending`): for families whose decoder layer does not pass the
# forward's keyword arguments on to its attention (StableLM, Falcon), which then arrive without `slot_layout`
_LAYOUT: ContextVar = ContextVar("slot_layout", default=None)


@contextmanager
def attending(layout):
    """Within: the slot attention reads `layout` where a call does not carry it as `slot_layout`."""
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over the slot store. query packed [1, heads, num_tokens, head_dim]; key/value
    [batch, kv_heads, kv_len, head_dim]; attention_mask from `attention_masks()` above (the split's
    second in layout.rest_mask). Returns the packed output [1, num_tokens, heads, head_dim].
    The features some families pass (hf_config.AttentionFeatures): `softcap`, `s_aux` (sinks, one
    logit per head) and `sliding_window` (this layer's window; None on a global layer) are computed
    on the padded path, soft-caps and windows by FlexAttention too; a runner whose model has any does
    not take our kernel, one with sinks not FlexAttention either.
    Calls outside a runner's forward (e.g. HF `generate` on the same model) fall through to SDPA."""
    lay = kwargs.get("slot_layout") or _LAYOUT.get()
    if lay is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    featured = window is not None or softcap is not None or sinks is not None
    if featured and (lay.kernel is not None or (lay.flex is not None and sinks is not None)):
        raise RuntimeError(f"{type(module).__name__} computes soft-capping, sinks or a sliding window, which "
                           f"{'our CPU kernel' if lay.kernel is not None else 'FlexAttention'} does not here: the "
                           f"runner keeps that path for models without them (hf_config.attention_features)")
    batch, max_q = lay.is_valid.shape
    if lay.kernel is not None:
        out = lay.kernel(query[0].transpose(0, 1), key, value, lay.row_table, scaling,
                         lay.tree.token_bits if lay.tree is not None else None)
        return out.unsqueeze(0), None                                          # [1, num_tokens, heads, dim]
    if lay.flex is not None:
        return slot_flex_attention(query, key, value, lay.token_slot, lay.token_q, lay.flex, max_q, scaling,
                                   lay.tree.token_bits if lay.tree is not None else None,
                                   (softcap, window, lay.flat_position_ids[0]) if featured else None), None
    masks = (attention_mask, lay.rest_mask)
    if window is not None and window < lay.kv_len:
        masks = lay.windowed(window, query.shape[1] // key.shape[1], attention_mask.dtype)
    extra = _Extra(softcap, sinks)
    if lay.split is not None:
        return _split_attention(query, key, value, masks, lay.split, max_q, scaling, extra), None
    tokens = query[0].transpose(0, 1)                                          # [num_tokens, heads, dim]
    padded = tokens.new_zeros(batch, max_q, *tokens.shape[1:])                 # unpack into rows
    padded[lay.token_row, lay.token_q] = tokens
    out = _attend_rows(padded, key, value, masks[0], scaling, extra)
    return out[lay.token_row, lay.token_q].unsqueeze(0), None                # [1, num_tokens, heads, dim]


@dataclass(frozen=True)
class _Extra:
    softcap: float | None = None        # scores -> softcap * tanh(scores / softcap), before the mask
    sinks: torch.Tensor | None = None   # [heads] one more logit per head in the softmax, attending to nothing


def _attend_rows(padded: torch.Tensor, key, value, mask, scaling, extra: _Extra = _Extra()) -> torch.Tensor:
    """Masked attention for padded query rows [rows, q, heads, dim] over key/value [rows, kv_heads,
    kv_len, dim]. Returns [rows, q, heads, dim]."""
    rows, q_len, num_heads, head_dim = padded.shape
    num_kv_heads = key.shape[1]
    groups = num_heads // num_kv_heads
    # Fold the query heads sharing a KV head into the query axis: no K/V repeat (CPU SDPA ignores enable_gqa).
    q = padded.permute(0, 2, 1, 3).reshape(rows, num_kv_heads, groups * q_len, head_dim)
    if extra.softcap is None and extra.sinks is None:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    else:
        out = _explicit(q, key, value, mask, scaling, extra, groups, q_len)
    return out.reshape(rows, num_heads, q_len, head_dim).permute(0, 2, 1, 3)


def _explicit(q, key, value, mask, scaling, extra: _Extra, groups: int, q_len: int) -> torch.Tensor:
    """The attention SDPA computes, written out with soft-capping and sinks, in float32 (the families'
    eager references compute the softmax in float32). q [rows, kv_heads, groups * q, dim] with query
    head kv * groups + g at rows g * q_len ... of its KV head."""
    scores = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scaling    # [rows, kv, groups * q, kv_len]
    if extra.softcap is not None:
        scores = torch.tanh(scores / extra.softcap) * extra.softcap
    if mask is not None:
        scores = scores + mask.float()
    if extra.sinks is not None:
        sinks = extra.sinks.float().view(key.shape[1], groups, 1).expand(-1, -1, q_len).reshape(1, key.shape[1], -1, 1)
        scores = torch.cat([scores, sinks.expand(scores.shape[0], -1, -1, 1)], dim=-1)
        probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value.float()).to(q.dtype)


def _split_attention(query, key, value, masks, split: SplitRows, max_q: int, scaling,
                     extra: _Extra = _Extra()) -> torch.Tensor:
    """SplitRows' two padded attentions: [batch, 1] first tokens over every row's keys (the cache's
    view when slots are contiguous), [multi, max_q - 1] other tokens over the multi rows' keys only."""
    tokens = query[0].transpose(0, 1)                                          # [num_tokens, heads, dim]
    out = torch.empty_like(tokens)
    out[split.row_starts] = _attend_rows(tokens[split.row_starts].unsqueeze(1), key, value, masks[0], scaling,
                                         extra)[:, 0]
    rest = tokens.new_zeros(split.multi.shape[0], max_q - 1, *tokens.shape[1:])
    rest[split.rest_row, split.rest_q] = tokens[split.rest_tokens]
    out[split.rest_tokens] = _attend_rows(rest, key[split.multi, :, :split.kv_len], value[split.multi, :, :split.kv_len],
                                          masks[1], scaling, extra)[split.rest_row, split.rest_q]
    return out.unsqueeze(0)                                                    # [1, num_tokens, heads, dim]


def register_attention() -> None:
    """Register the slot attention (and SDPA's mask builder for non-slot calls). Idempotent."""
    AttentionInterface.register(ATTENTION_NAME, slot_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)

