"""StepLayout: where one forward's tokens go, and the padded path's masks.

Tokens travel packed ([1, num_tokens]) through the model, so projections and MLPs never compute
padding; attention unpacks them into rows. The layout holds, per row, its slot, the position of its
first new token and its number of new tokens, as views of one buffer copied to the device once per
forward. A kernel that reads each row's own keys (the runner's CPU kernel, FlexAttention's block
tables) rides along as an opaque handle the runner sets.

Token trees (core/tree.py): a row may be a tree, its inputs the root (the last committed token) and
its draft tokens with their parents. Its KV is still written at start + input index, but each
input's RoPE position is start + its depth, and it attends to the keys before start and to the
inputs its visibility bits name (the root, its ancestors, itself): `TreeRows`. Other rows of a tree
step carry all bits set, so the same test is the causal one for them.

It knows nothing about requests, drafting, sampling or the kernels themselves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..core.tree import depths, is_chain, visible_inputs


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
class TreeRows:
    """A step with token trees: per token, where its KV goes and what it may see (module docstring)."""
    write_pos: torch.Tensor    # [batch, max_q] int64 KV position: start + input index (padding: the last)
    bits: torch.Tensor         # [batch, max_q] int64 visibility bits over the row's inputs; -1 (all): causal
    token_write_pos: torch.Tensor  # [num_tokens] the same, packed
    token_bits: torch.Tensor       # [num_tokens]


def visible(keys: torch.Tensor, write_pos: torch.Tensor, start: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Whether a query at KV position write_pos of a row starting at `start`, with visibility bits
    `bits`, sees key position `keys` (broadcast): causal, and within the row's inputs only the ones its
    bits name (bits -1: all of them)."""
    rel = keys - start
    named = ((bits >> rel.clamp(0, 62)) & 1) == 1
    return (keys <= write_pos) & ((rel < 0) | (rel > 62) | named)


@dataclass
class StepLayout:
    """Where one forward's tokens go. The model sees them packed flat ([1, num_tokens]: no padding in
    the projections and MLPs); attention unpacks them into padded [batch, max_q] rows. Every tensor
    is a view of one buffer copied to the device once per forward (make_layout)."""
    input_ids: torch.Tensor    # [1, num_tokens] int64 the tokens, packed row after row
    slots: torch.Tensor        # [batch] int64 slot of each row
    row_table: torch.Tensor    # [4, batch] int64 slot, start, number of new tokens, first packed token
    row_ends: torch.Tensor     # [batch] int64 packed index of each row's last token
    position_ids: torch.Tensor  # [batch, max_q] int64 RoPE positions (padding repeats the last real one);
                                # also the KV positions, except in a tree step (then `tree.write_pos`)
    is_valid: torch.Tensor     # [batch, max_q] bool real token (not padding)
    token_row: torch.Tensor    # [num_tokens] int64 row of each packed token
    token_q: torch.Tensor      # [num_tokens] int64 index of each packed token within its row
    kv_len: int                # keys read per row: max over rows of start + num_new
    slot_range: tuple[int, int] | None  # (lo, hi) when slots == arange(lo, hi): read a view, not a gather
    flex: tuple[torch.Tensor, ...] | None = None  # block tables (set by the runner): attention over the
                                                  # whole store, each row reading its own blocks only
    split: SplitRows | None = None  # the padded path's split when few rows have more than one token
    rest_mask: torch.Tensor | None = None  # the split's second mask (attention_masks), set by the runner
    kernel: Callable | None = None  # a kernel attending each row over its own keys in the whole store
                                    # (the runner's CPU kernel): no padding, no mask, no split
    tree: TreeRows | None = None    # a step with token trees (None: every row a single causal run)
    window_masks: dict | None = None  # window -> attention_masks with it (`windowed`), made by the forward's
                                      # first layer of that window; reset by the runner before each forward

    def windowed(self, window: int, num_groups: int, dtype: torch.dtype) -> tuple:
        """attention_masks with a sliding window: the masks of a layer that attends only to its last
        `window` positions, made once per forward."""
        if self.window_masks is None:
            self.window_masks = {}
        if window not in self.window_masks:
            self.window_masks[window] = attention_masks(self, num_groups, dtype, window)
        return self.window_masks[window]

    @property
    def token_write_pos(self) -> torch.Tensor:          # [num_tokens] KV position of each packed token
        if self.tree is not None:
            return self.tree.token_write_pos
        return self.position_ids[self.token_row, self.token_q]

    @property
    def token_slot(self) -> torch.Tensor:               # [num_tokens] slot of each packed token
        return self.slots[self.token_row]

    @property
    def flat_position_ids(self) -> torch.Tensor:        # [1, num_tokens]
        return self.position_ids[self.token_row, self.token_q].unsqueeze(0)


def make_layout(slots: list[int], starts: list[int], tokens: list[list[int]], device: torch.device,
                flex: bool = False, kernel: Callable | None = None,
                parents: list[list[int] | None] | None = None, last_tokens: torch.Tensor | None = None) -> StepLayout:
    """The layout for rows of new tokens tokens[b] at positions starts[b]... in slots[b], built on
    the host as plain ints and copied to the device in one transfer (a GPU step is otherwise a string
    of tiny copies). flex: attention takes the FlexAttention path (the runner then sets the block
    tables); kernel: a kernel that attends instead of the padded path (at most one of the two).
    parents[b]: row b is a token tree, tokens[b] its root and then its draft tokens with these
    parents (core/tree.py); None (or parents None): a single causal run. last_tokens: [rows] on the
    device, each row's last token in place of tokens[b][-1] (a placeholder the host never read back)."""
    if parents is not None and all(p is None or is_chain(p) for p in parents):
        parents = None
    num_new = [len(t) for t in tokens]
    batch, max_q, num_tokens = len(slots), max(num_new), sum(num_new)
    ends, end = [], -1
    for n in num_new:
        end += n
        ends.append(end)
    firsts = [e - n + 1 for e, n in zip(ends, num_new)]                   # packed index of each row's first token
    multi = [b for b, n in enumerate(num_new) if n > 1]
    split = not flex and kernel is None and multi and 2 * len(multi) <= batch   # see SplitRows
    split_ids = (multi
                 + [e - n + 1 + q for m in multi for e, n in [(ends[m], num_new[m])] for q in range(1, n)]
                 + [i for i, m in enumerate(multi) for _ in range(1, num_new[m])]
                 + [q - 1 for m in multi for q in range(1, num_new[m])]) if split else []
    offsets = ([list(range(n)) if p is None else [0] + depths(p) for p, n in zip(parents, num_new)]
               if parents is not None else [range(n) for n in num_new])
    host = torch.tensor(
        [t for row in tokens for t in row] + slots + starts + num_new + firsts + ends
        + [s + off[min(q, n - 1)] for s, n, off in zip(starts, num_new, offsets) for q in range(max_q)]
        + [int(q < n) for n in num_new for q in range(max_q)]
        + [r for r, n in enumerate(num_new) for _ in range(n)]
        + [q for n in num_new for q in range(n)] + split_ids + _tree_host(parents, starts, num_new, max_q),
        dtype=torch.long)
    rest = num_tokens - batch
    (input_ids, row_table, ends_t, position_ids, is_valid, token_row, token_q,
     *more) = host.to(device).split([num_tokens, 4 * batch, batch] + [batch * max_q] * 2 + [num_tokens] * 2
                                    + ([len(multi)] + [rest] * 3 if split else [])
                                    + ([batch * max_q] * 2 + [num_tokens] * 2 if parents is not None else []))
    split_t, tree_t = (more[:4], more[4:]) if split else ([], more)
    row_table = row_table.view(4, batch)
    if last_tokens is not None:
        input_ids.index_copy_(0, ends_t, last_tokens)
    contiguous = slots == list(range(slots[0], slots[0] + batch))
    return StepLayout(
        input_ids=input_ids.unsqueeze(0), slots=row_table[0], row_table=row_table, row_ends=ends_t,
        position_ids=position_ids.view(batch, max_q), is_valid=is_valid.view(batch, max_q).bool(),
        token_row=token_row, token_q=token_q,
        kv_len=max(s + n for s, n in zip(starts, num_new)),
        slot_range=(slots[0], slots[0] + batch) if contiguous else None,
        split=SplitRows(row_table[3], *split_t, kv_len=max(starts[m] + num_new[m] for m in multi)) if split else None,
        kernel=kernel,
        tree=TreeRows(tree_t[0].view(batch, max_q), tree_t[1].view(batch, max_q), *tree_t[2:]) if tree_t else None,
    )


def _tree_host(parents: list[list[int] | None] | None, starts: list[int], num_new: list[int], max_q: int) -> list[int]:
    """TreeRows' tensors as host ints ([] without trees): write positions and bits, padded then packed."""
    if parents is None:
        return []
    bits = [[-1] * n if p is None else visible_inputs(p) for p, n in zip(parents, num_new)]
    for p, n in zip(parents, num_new):
        if p is not None and len(p) + 1 != n:
            raise ValueError(f"token tree of {len(p)} parents for a row of {n} inputs (root + draft tokens)")
    return ([s + min(q, n - 1) for s, n in zip(starts, num_new) for q in range(max_q)]
            + [row[q] if q < n else -1 for row, n in zip(bits, num_new) for q in range(max_q)]
            + [s + q for s, n in zip(starts, num_new) for q in range(n)]
            + [b for row in bits for b in row])


def attention_masks(layout: StepLayout, num_groups: int, dtype: torch.dtype,
                    sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The padded path's additive masks: (the one transformers hands every layer as attention_mask,
    the split's second or None). Row (b, q) sees keys 0..position(b, q); query heads sharing a KV head
    are folded into the query axis (see slot_attention). Unsplit: [batch, 1, num_groups * max_q,
    kv_len]. Split: [batch, 1, num_groups, kv_len] for every row's first token, and [multi, 1,
    num_groups * (max_q - 1), split.kv_len] for the rest."""
    split, tree = layout.split, layout.tree
    rope = layout.position_ids
    if tree is None:
        query = (rope, rope, None, None)
    else:                                     # (RoPE position, KV position, row start, bits) per query
        query = (rope, tree.write_pos, layout.row_table[1].unsqueeze(1), tree.bits)
    if split is None:
        return _mask(query, layout.kv_len, num_groups, dtype, sliding_window), None
    first = tuple(None if t is None else t[:, :1] for t in query)
    rest = (*(t[split.multi, 1:] for t in query[:2]),
            *(None if t is None else t[split.multi, 1:] if t.shape[1] > 1 else t[split.multi] for t in query[2:]))
    return (_mask(first, layout.kv_len, num_groups, dtype, sliding_window),
            _mask(rest, split.kv_len, num_groups, dtype, sliding_window))


def _mask(query: tuple, kv_len: int, num_groups: int, dtype: torch.dtype, sliding_window: int | None) -> torch.Tensor:
    """query: (RoPE positions [rows, q], KV positions [rows, q], row starts [rows, 1] or None, bits
    [rows, q] or None)."""
    rope, write_pos, start, bits = query
    keys = torch.arange(kv_len, device=write_pos.device)                       # [kv_len]
    pos = write_pos.unsqueeze(-1)                                              # [rows, q, 1]
    allowed = (keys <= pos if bits is None
               else visible(keys, pos, start.unsqueeze(-1), bits.unsqueeze(-1)))   # [rows, q, kv_len]
    if sliding_window is not None:             # by RoPE distance (a tree's ancestors are always within)
        allowed &= keys > rope.unsqueeze(-1) - sliding_window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    rows, q, _ = mask.shape
    return mask.unsqueeze(1).expand(rows, num_groups, q, kv_len).reshape(rows, 1, num_groups * q, kv_len)

