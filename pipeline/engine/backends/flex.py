"""Slot attention whose cost per row follows that row's own length: FlexAttention over the slot store.

The eager path (kv_cache.slot_attention) pads every row's keys to the longest row of the step and
adds a float mask, so one long row makes every row pay for its length. Here the query rows go to
their slots in a [num_slots, heads, max_q, head_dim] tensor, the keys and values are the slot store
itself (no gather, no copy), and a block mask built from each slot's start and new-token count
tells the kernel which key blocks each row reads:

  block       BLOCK consecutive key positions (and BLOCK consecutive query rows) of one slot
  full block  keys all at or before the block's first query position: every query sees all of
              them, no per-element mask is evaluated
  partial     the blocks holding the row's new positions: `kv <= start + q` is evaluated per element
  skipped     everything past the row's last new position, and every block of a slot with no row
              this step: never read

So a row costs ceil((start + num_new) / BLOCK) key blocks, whatever the other rows hold. The block
mask is built from per-slot tensors with a few vectorised ops (no Python per row, no
`create_block_mask` over the whole [q, kv] grid) inside the compiled function, so it costs well under
a millisecond per step; the per-slot start positions reach the mask through an argument, which keeps
one compiled graph for every runner and every step (dynamic in the number of query rows).

Token trees (kv/layout.py's TreeRows): the mask also asks which of its row's inputs each query sees
(the visibility bits unpacked into a flat boolean table), and only the blocks wholly before a slot's
start count as full (a tree's inputs see some of the earlier inputs of their step, not all). A
separate compiled function takes the table.

FlexAttention needs torch.compile: inductor's C++ kernel on CPU, Triton on CUDA. `flex_unavailable`
says why a device cannot take this path; the caller then keeps the eager one.

This module knows nothing about requests, models or the engine; it sees tensors and a layout.
"""
from __future__ import annotations

import shutil
from functools import lru_cache

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128          # key and query block size (FlexAttention's default)

# Cost of a key position read by the flex kernel relative to one read by the eager padded SDPA kernel.
# Measured on a 2-core AVX2 CPU, fp32, 32 rows x 5 queries, 9/3 heads of 64 (bench/RESULTS.md,
# "CPU kernels"): 0.62 vs 0.37-0.52 us per row-key, so on CPU flex pays only where padding wastes more
# than that. CUDA: not measured yet; taken as even, so flex (no padding, no mask) always wins there.
FLEX_RELATIVE_COST = {"cpu": 1.6, "cuda": 1.0}


def prefer_flex(ends: list[int], device: torch.device) -> bool:
    """Whether flex is the cheaper kernel for rows whose keys end at ends[b] (start + new tokens): flex
    reads each row's own blocks, the eager kernel pads every row to the longest."""
    flex_keys = sum(-(-end // BLOCK) * BLOCK for end in ends)
    return FLEX_RELATIVE_COST.get(device.type, 1.0) * flex_keys < len(ends) * max(ends)


def capacity(max_len: int) -> int:
    """Slot positions to allocate: max_len rounded up to whole blocks (the kernel reads whole blocks)."""
    return -(-max_len // BLOCK) * BLOCK


def block_tables(slots: torch.Tensor, starts: torch.Tensor, num_new: torch.Tensor, num_slots: int,
                 max_q: int, num_kv_blocks: int, tree: bool = False) -> tuple[torch.Tensor, ...]:
    """Per-slot tables for BlockMask.from_kv_blocks, from the step's rows (slots[b] gets num_new[b]
    query rows at positions starts[b]...): (partial counts, partial indices, full counts, full
    indices, start of each slot), each [num_slots, 1, num_q_blocks(, num_kv_blocks)] int32 except
    the starts ([num_slots] int64). Slots without a row get no block at all. tree: a step with
    token trees (only the blocks before each start are full)."""
    device = starts.device
    slot_start = torch.zeros(num_slots, dtype=torch.long, device=device).index_copy_(0, slots, starts)
    slot_new = torch.zeros(num_slots, dtype=torch.long, device=device).index_copy_(0, slots, num_new)
    q0 = torch.arange(0, max_q, BLOCK, device=device).unsqueeze(0)           # [1, q_blocks] first q row
    live = q0 < slot_new.unsqueeze(1)                                          # block has a real query
    first_q = slot_start.unsqueeze(1) + q0                                     # its first query position
    end_q = slot_start.unsqueeze(1) + torch.minimum(q0 + BLOCK, slot_new.unsqueeze(1))   # past its last
    seen = slot_start.unsqueeze(1) if tree else first_q + 1                    # keys every query sees
    full = torch.where(live, seen // BLOCK, 0)                                 # blocks 0..full-1 are full
    upto = torch.where(live, -(-end_q // BLOCK), 0)                            # partial: full..upto-1
    kv = torch.arange(num_kv_blocks, device=device)
    partial_idx = (full.unsqueeze(-1) + kv).clamp(max=num_kv_blocks - 1)
    full_idx = kv.expand(num_slots, q0.shape[1], num_kv_blocks)
    as_table = lambda t: t.to(torch.int32).unsqueeze(1).contiguous()
    return as_table(upto - full), as_table(partial_idx), as_table(full), as_table(full_idx), slot_start


def window_blocks(partial_num: torch.Tensor, full_num: torch.Tensor, slot_start: torch.Tensor, window: torch.Tensor,
                  width: int, num_kv_blocks: int, tree: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """block_tables' blocks for a layer with a sliding window: (partial counts, partial indices), every
    block partial, the blocks wholly before every window of a query block skipped. A query at RoPE
    position p sees keys past p - window; the query block's lowest position is its slot's start plus its
    first row (a token tree's inputs sit at start + depth: the start itself), so key blocks before
    (lowest - window + 1) // BLOCK are read by none of its queries. At long context a windowed layer
    reads about window / BLOCK + 2 blocks per query block, not every block from 0."""
    upto = partial_num + full_num                                              # blocks 0..upto-1 hold its keys
    q0 = torch.arange(0, width, BLOCK, device=slot_start.device).view(1, 1, -1)
    lowest = slot_start.view(-1, 1, 1) + (0 if tree else q0)
    first = torch.minimum(((lowest - window + 1).clamp(min=0) // BLOCK).to(upto.dtype), upto)
    kv = torch.arange(num_kv_blocks, device=slot_start.device)
    return upto - first, (first.unsqueeze(-1) + kv).clamp(max=num_kv_blocks - 1).to(upto.dtype)


def _attend(query, key, value, partial_num, partial_idx, full_num, full_idx, slot_start, scale: torch.Tensor):
    """query [num_slots, heads, max_q, dim] (row q of slot b at position slot_start[b] + q); key/value
    the slot store [num_slots, kv_heads, capacity, dim]; scale a 0-d tensor (a Python float would be
    a constant of the graph: one recompile per model's head size). Returns [num_slots, heads, max_q, dim]."""
    def causal(b, h, q, kv):
        return kv <= slot_start[b] + q
    mask = BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=(BLOCK, BLOCK),
                                    mask_mod=causal, seq_lengths=(query.shape[2], key.shape[2]),
                                    compute_q_blocks=False)
    return flex_attention(query * scale, key, value, block_mask=mask, scale=1.0,
                          enable_gqa=query.shape[1] != key.shape[1])


def _attend_tree(query, key, value, partial_num, partial_idx, full_num, full_idx, slot_start, slot_sees,
                 scale: torch.Tensor):
    """_attend for a step with token trees: slot_sees [num_slots * max_q * max_q] bool, whether query q
    of slot b sees the slot's input j at (b * max_q + q) * max_q + j (one flat lookup: inductor's CPU
    template mis-compiled bit tests and multi-dimensional lookups by q in a mask_mod)."""
    width = query.shape[2]

    def tree_causal(b, h, q, kv):
        rel = kv - slot_start[b]
        named = slot_sees[(b * width + q) * width + rel.clamp(0, width - 1)]
        return (kv <= slot_start[b] + q) & ((rel < 0) | (rel >= width) | named)
    mask = BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=(BLOCK, BLOCK),
                                    mask_mod=tree_causal, seq_lengths=(query.shape[2], key.shape[2]),
                                    compute_q_blocks=False)
    return flex_attention(query * scale, key, value, block_mask=mask, scale=1.0,
                          enable_gqa=query.shape[1] != key.shape[1])


def _attend_features(query, key, value, partial_num, partial_idx, full_num, full_idx, slot_start, scale: torch.Tensor,
                     positions: torch.Tensor, softcap: torch.Tensor | None, window: torch.Tensor | None,
                     slot_sees: torch.Tensor | None):
    """_attend (slot_sees: _attend_tree) with what some families' attention adds (hf_config's
    AttentionFeatures): softcap (0-d) maps each score s to softcap * tanh(s / softcap); window (0-d)
    keeps the keys within `window` positions of the query's RoPE position (positions [num_slots *
    max_q]: of query q of slot b at b * max_q + q), every block it reads then evaluated per element and
    the blocks before every window skipped (window_blocks). Sinks are
    not here: they need the softmax's logsumexp, which inductor's CPU FlexAttention does not return."""
    width = query.shape[2]

    def visible(b, h, q, kv):
        seen = kv <= slot_start[b] + q
        if slot_sees is not None:
            rel = kv - slot_start[b]
            named = slot_sees[(b * width + q) * width + rel.clamp(0, width - 1)]
            seen = seen & ((rel < 0) | (rel >= width) | named)
        if window is not None:
            seen = seen & (kv > positions[b * width + q] - window)
        return seen

    def capped(score, b, h, q, kv):
        return softcap * torch.tanh(score / softcap)
    if window is not None:         # every block partial (none full), from the first one in any query's window
        partial_num, partial_idx = window_blocks(partial_num, full_num, slot_start, window, width,
                                                 full_idx.shape[-1], tree=slot_sees is not None)
        full_num = full_idx = None
    mask = BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=(BLOCK, BLOCK),
                                    mask_mod=visible, seq_lengths=(query.shape[2], key.shape[2]),
                                    compute_q_blocks=False)
    return flex_attention(query * scale, key, value, score_mod=capped if softcap is not None else None,
                          block_mask=mask, scale=1.0, enable_gqa=query.shape[1] != key.shape[1])


@lru_cache(maxsize=None)
def compiled_attend_features():
    return torch.compile(_attend_features, dynamic=True)


@lru_cache(maxsize=None)
def compiled_attend_tree():
    return torch.compile(_attend_tree, dynamic=True)


@lru_cache(maxsize=None)
def compiled_attend():
    """The compiled kernel, shared by every runner: one graph per (dtype, heads, kv heads, head
    size), dynamic in slots and query rows. Not fullgraph: past dynamo's recompile limit (8 variants
    in one process) it runs uncompiled, slower but exact, instead of failing."""
    return torch.compile(_attend, dynamic=True)


def flex_unavailable(device: torch.device) -> str | None:
    """Why FlexAttention cannot be compiled for `device`, or None when it can."""
    if device.type == "cpu":
        if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
            return "no C++ compiler on PATH (inductor builds CPU kernels with one)"
        return None
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed (inductor's CUDA kernels need it)"
        return None
    return f"device type {device.type!r} is not supported"


@lru_cache(maxsize=64)
def _scale_tensor(scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 0-d scale, made once (not one host-to-device copy per layer per forward)."""
    return torch.tensor(scale, dtype=dtype, device=device)


def slot_flex_attention(query: torch.Tensor, key_store: torch.Tensor, value_store: torch.Tensor,
                        token_slot: torch.Tensor, token_q: torch.Tensor, tables: tuple[torch.Tensor, ...],
                        max_q: int, scale: float | None, token_bits: torch.Tensor | None = None,
                        features: tuple | None = None) -> torch.Tensor:
    """Attention for packed queries [1, heads, num_tokens, dim] (token t is row token_q[t] of slot
    token_slot[t]) over the whole slot store; token_bits [num_tokens]: a tree step's visibility bits
    (tables built with tree=True). features: (softcap, window, RoPE positions [num_tokens]) where the
    model's attention has either (_attend_features). Returns the packed output [1, num_tokens, heads, dim]."""
    _, num_heads, _, head_dim = query.shape
    num_slots = key_store.shape[0]
    rows = query.new_zeros(num_slots, max_q, num_heads, head_dim)
    rows[token_slot, token_q] = query[0].transpose(0, 1)
    scale = _scale_tensor(head_dim ** -0.5 if scale is None else scale, query.dtype, query.device)
    sees = None
    if token_bits is not None:
        inputs = torch.arange(max_q, device=query.device)
        sees = torch.ones(num_slots, max_q, max_q, dtype=torch.bool, device=query.device)   # causal rows: all
        sees[token_slot, token_q] = ((token_bits.unsqueeze(1) >> inputs.clamp(max=62)) & 1 == 1) | (inputs > 62)
        sees = sees.view(-1)
    if features is not None:
        softcap, window, token_pos = features
        positions = torch.zeros(num_slots * max_q, dtype=torch.long, device=query.device)
        positions[token_slot * max_q + token_q] = token_pos
        # contiguous: inductor's CPU template fails to compile (CppCompileError, torch 2.13) a mask that reads
        # `positions` by query row over strided queries once the keys span more than one block
        out = compiled_attend_features()(
            rows.transpose(1, 2).contiguous(), key_store, value_store, *tables, scale, positions,
            None if softcap is None else _scale_tensor(float(softcap), torch.float32, query.device),
            None if window is None else _scale_tensor(float(window), torch.long, query.device), sees)
    elif sees is None:
        out = compiled_attend()(rows.transpose(1, 2), key_store, value_store, *tables, scale)
    else:
        out = compiled_attend_tree()(rows.transpose(1, 2), key_store, value_store, *tables, sees, scale)
    return out.transpose(1, 2)[token_slot, token_q].unsqueeze(0)
