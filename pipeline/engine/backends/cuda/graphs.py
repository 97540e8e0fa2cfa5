"""A step replayed as one CUDA graph: the GPU forward without a dozen Python-issued launches per layer.

On a GPU, a decoding step of a small model (or of any model at small batch) is launch-bound: the
weights stream in tens of microseconds, but every layer issues its projections, norms, RoPE, the KV
write and attention as separate kernel launches from Python. Capturing the forward once per shape
and replaying it leaves one launch per step (vLLM and nano-vllm do the same for decoding).

A graph fixes shapes and addresses, so a step is padded to a bucket:

  bucket    (rows, tokens per row, keys, logits): rows rounded up to a power of two (at most the
            runner's slots), every row padded to the step's longest (1..MAX_Q tokens), the keys each
            row reads rounded up to a power of two >= the step's furthest position (at most the
            store), logits "all" or "last"; at most MAX_TOKENS tokens (rows x tokens per row)
  pad token a row's tokens past its real ones, at positions start + n .. start + q - 1 of its own
            slot: past the row's computed length, where stale KV is already allowed (a rollback leaves
            it, the mask hides it, the next real token there overwrites it). The store has MAX_Q - 1
            positions more than max_model_len, so these never run off its end
  pad row   rows past the step's real ones: the spare slot (the store has one more than the engine
            uses), positions 0 .. q - 1; only pad rows read it
  buffers   one static int64 device buffer per bucket (input ids, the row table, positions, each row's
            last packed token; a tree bucket also each token's KV position and visibility bits),
            filled by one host-to-device copy per step; the logits land in one output
            buffer shared by every graph, so a captured graph keeps no vocabulary-sized tensor

A verify step's graph may also hold a tail: a function of every position's logits with static
inputs of its own (core/verify_step.py: logits processing and the verifier's rule), so that the step
replays forward and verification together and the host reads back one small buffer, not logits. Its
inputs travel in the forward's one host-to-device copy. A tail whose capture raises or whose replay
differs from its uncaptured run turns tails off (verification then runs after the forward's graph).

Attention inside a graph goes by lengths where the runner has FlexAttention (backends/flex.py): the
block tables are built in the graph from the row table (each row's slot, start and tokens), so a row
reads its own key blocks and nothing is gathered or masked over the keys bucket, which is then one
size (the store's) for every step. Elsewhere it is the padded path of kv_cache.slot_attention, its
float mask built in the graph from the positions. Static shapes, no host sync, either way. A capture
that fails with attention by lengths turns that off first (the padded path is captured next). A step
with token trees (kv/layout.py's TreeRows) has buckets of its own, whose mask also reads the rows'
starts and the tokens' bits. Prefill (logits "none") and steps past the largest bucket run eagerly, as
do all steps where graphs are off.

Each bucket is captured on first use, after one uncaptured run of the same padded forward on the same
inputs (which also warms up the kernels). Its first replay must reproduce that run's logits for the
real tokens (the same kernels on the same inputs), or graphs are switched off for this runner with a
warning and the uncaptured result is used; a capture that raises (an op that syncs with the host,
say) does the same. A model whose forward cannot be captured runs at eager speed, never wrongly. The
KV both runs write is the same (a position's KV depends only on the tokens up to it), so running the
step twice changes nothing.

`capture=None` runs the identical padded forward without capturing: on CPU, it is how the tests
check everything but the capture itself (buckets, padding, buffers, masks, the logits' gather).

This module knows nothing about requests or drafting; it sees a runner's forward and a layout.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.engine.config import MODES
from pipeline.engine.core.tree import depths, visible_inputs
from pipeline.engine.kv.layout import StepLayout, TreeRows, attention_masks

UNCAPTURED = "uncaptured"  # a runner's mode, not a config value: the padded forward without capture (CPU tests)
MAX_Q = 17                # tokens per row in a graph: a verify step of up to 16 draft tokens (a path or a tree)
MAX_TOKENS = 512          # rows x tokens per row in a graph; larger steps are compute-bound anyway
MIN_KEYS = 256            # the smallest keys bucket


def policy(mode: str, device: torch.device) -> bool:
    """Whether a runner on `device` captures graphs: auto (on CUDA), on (raises elsewhere), off."""
    if mode not in MODES:
        raise ValueError(f"engine.cuda_graphs: expected one of {MODES}, got {mode!r}")
    if mode == "off":
        return False
    if device.type != "cuda":
        if mode == "on":
            raise RuntimeError(f"engine.cuda_graphs=on needs a CUDA device, the model is on {device}")
        return False
    return True


@dataclass(frozen=True)
class Bucket:
    rows: int
    q: int            # tokens per row
    keys: int         # key positions each row reads
    logits: str       # "all" | "last"
    tree: bool = False   # a step with token trees

    @property
    def tokens(self) -> int:
        return self.rows * self.q


class _BucketState:
    """One bucket's static layout and buffer (and, once captured, its graph)."""

    def __init__(self, bucket: Bucket, spare_slot: int, device: torch.device):
        rows, q = bucket.rows, bucket.q
        self.bucket = bucket
        # [input ids (rows*q) | row table (4*rows: slot, start, q, first packed token) | positions (rows*q) |
        #  last packed token of each row (rows) | tree buckets: KV positions (rows*q), bits (rows*q)]
        self.sizes = [rows * q, 4 * rows, rows * q, rows] + ([rows * q] * 2 if bucket.tree else [])
        self.buffer = torch.cat([torch.zeros(rows * q, dtype=torch.long),
                                 torch.full((rows,), spare_slot, dtype=torch.long), torch.zeros(rows, dtype=torch.long),
                                 torch.full((rows,), q, dtype=torch.long), torch.arange(rows) * q,
                                 torch.arange(q).repeat(rows),
                                 torch.arange(rows) * q + q - 1]
                                + ([torch.arange(q).repeat(rows), torch.full((rows * q,), -1)] if bucket.tree else [])
                                ).to(device)
        input_ids, row_table, positions, row_ends, *tree = self.buffer.split(self.sizes)
        row_table = row_table.view(4, rows)
        token_row = torch.arange(rows, device=device).repeat_interleave(q)
        self.layout = StepLayout(
            input_ids=input_ids.unsqueeze(0), slots=row_table[0], row_table=row_table,
            row_ends=row_ends, position_ids=positions.view(rows, q),
            is_valid=torch.ones(rows, q, dtype=torch.bool, device=device),
            token_row=token_row, token_q=torch.arange(q, device=device).repeat(rows),
            kv_len=bucket.keys, slot_range=None,
            tree=TreeRows(tree[0].view(rows, q), tree[1].view(rows, q), tree[0], tree[1]) if tree else None)
        self.replay: Callable[[], None] | None = None      # set once captured and checked


def _replays(replayed: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether a replay's logits are its uncaptured run's (the same kernels on the same inputs, to 1e-3
    of the largest logit)."""
    scale = reference.abs().max().clamp(min=1.0)
    return bool(((replayed - reference).abs().max() <= 1e-3 * scale).item())


class CudaCapture:
    """The CUDA runtime's part: warm up on a side stream, capture into one memory pool shared by every
    graph of the runner (one step replays at a time, so their intermediates may share memory), replay."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None

    def warm_up(self, fn: Callable[[], None]) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Record fn's kernels (without running them); returns the replay."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            fn()
        return graph.replay


class StepGraphs:
    """Padded, bucketed forwards of one runner, captured by `capture` (a CudaCapture), or with
    capture=None run exactly as they would be captured. `forward_fn(layout, mask, keep)` is the
    runner's model call: packed logits for the kept positions ([kept, vocab])."""

    def __init__(self, forward_fn: Callable[[StepLayout, torch.Tensor, object], torch.Tensor],
                 num_groups: int, dtype: torch.dtype, device: torch.device, num_slots: int, store_len: int,
                 capture: CudaCapture | None = None,
                 flex_tables: Callable[[StepLayout], tuple] | None = None):
        self.forward_fn = forward_fn
        self.flex_tables = flex_tables               # the layout's FlexAttention block tables; None: padded mask
        self.num_groups, self.dtype, self.device = num_groups, dtype, device
        self.spare_slot = num_slots                  # the store holds num_slots + 1 slots
        self.max_rows = num_slots
        self.store_len = store_len
        self.capture = capture
        self.enabled = True
        self.disabled_reason: str | None = None
        self._states: dict[Bucket, _BucketState] = {}
        self._out: torch.Tensor | None = None        # [MAX_TOKENS, vocab], every graph's logits
        self.num_replays = 0                         # steps served by a graph (or its uncaptured twin)
        self.num_tails = 0                           # of them, steps whose graph also ran a tail
        self.tails_enabled = True
        self.tails_disabled_reason: str | None = None
        self.flex_off_reason: str | None = None
        self._tails: dict = {}                       # (bucket, key) -> tail
        self.capture_s = 0.0                         # seconds spent in first uses: reference run, capture, check

    @staticmethod
    def store_rows(num_slots: int) -> int:
        """Slots the store must hold: the engine's, plus the spare one pad rows use."""
        return num_slots + 1

    @staticmethod
    def store_positions(max_model_len: int) -> int:
        """Positions per slot: max_model_len, plus room for the pad tokens of a row that ends there."""
        return max_model_len + MAX_Q - 1

    def bucket(self, starts: list[int], num_new: list[int], logits: str, tree: bool = False) -> Bucket | None:
        """The bucket this step pads to, or None when it takes the eager path. tree: the step has token trees."""
        if not self.enabled or logits not in ("all", "last") or len(num_new) > self.max_rows:
            return None
        q = max(num_new)
        rows = 1 << (len(num_new) - 1).bit_length()
        if q > MAX_Q or rows * q > MAX_TOKENS:
            return None
        rows = min(rows, self.max_rows)
        keys = self.store_len if self.flex_tables is not None else min(
            max(MIN_KEYS, 1 << (max(s + n for s, n in zip(starts, num_new)) - 1).bit_length()), self.store_len)
        return Bucket(rows, q, keys, logits, tree)

    def forward(self, bucket: Bucket, slots: list[int], starts: list[int], tokens: list[list[int]],
                parents: list[list[int] | None] | None = None,
                last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the step (as the eager forward returns them: every real token in row order for
        "all", each real row's last token for "last"), from the bucket's graph. parents: the rows'
        token trees (kv/layout.py's make_layout), for a tree bucket. last_tokens: [rows] on the device,
        each row's last token in place of tokens[b][-1] (ModelRunner.forward)."""
        state = self._state(bucket)
        real = [i for b, row in enumerate(tokens)
                for i in (range(b * bucket.q, b * bucket.q + len(row)) if bucket.logits == "all" else [b])]
        staged = self._stage(state, slots, starts, tokens, parents, torch.tensor(real, dtype=torch.long))
        real_idx = staged.view(torch.long)[state.buffer.numel():]
        if last_tokens is not None:                  # the ids lead the buffer: row b's last at b * q + n_b - 1
            state.buffer.index_copy_(0, state.layout.row_ends[:len(tokens)].clone(), last_tokens)
        self.num_replays += 1
        if self.capture is None:
            self._run(state)
            return self._real(bucket, real_idx)
        if state.replay is None:
            return self._capture(state, real_idx)
        state.replay()
        return self._real(bucket, real_idx)

    def tail(self, bucket: Bucket, key, make: Callable[[], "object"]):
        """The tail kept for (bucket, key), made by make() on first use; None where tails are off. A tail
        (core/verify_step.py's Tail) takes its staged inputs by `load(bytes)`, has an output `out`, a
        `run(logits)` over every position's logits and a `replay` slot for its graph."""
        if not self.tails_enabled or bucket.logits != "all":
            return None
        tail = self._tails.get((bucket, key))
        if tail is None:
            tail = self._tails[(bucket, key)] = make()
        return tail

    def forward_tail(self, bucket: Bucket, slots: list[int], starts: list[int], tokens: list[list[int]],
                     tail, tail_bytes: torch.Tensor, parents: list[list[int] | None] | None = None,
                     carry: tuple[torch.Tensor, list[tuple[int, int]]] | None = None) -> torch.Tensor:
        """The step's forward and then `tail` (from `tail()`) on its logits, as one graph: the forward's
        inputs and `tail_bytes` (uint8, the tail's inputs) arrive by one host-to-device copy. parents:
        the rows' token trees, for a tree bucket. carry (tokens, pairs): for each (b, i) in pairs, row
        b's last token (a placeholder in tokens[b]) is tokens[i] of that device tensor, a token the host
        has not read back (its index rides in the same copy). Returns the tail's output buffer on the
        device."""
        state = self._state(bucket)
        extra = tail_bytes
        if carry is not None:                        # rows b, then the carried tokens' indices i
            pairs = torch.tensor(carry[1], dtype=torch.long).reshape(-1, 2).T.reshape(-1)
            extra = torch.cat([tail_bytes, pairs.view(torch.uint8)])
        staged = self._stage(state, slots, starts, tokens, parents, extra)
        at = 8 * state.buffer.numel()
        tail.load(staged[at:at + tail_bytes.numel()])
        if carry is not None:                        # the ids lead the buffer: row b's last at row_ends[b]
            rows, index = staged[at + tail_bytes.numel():].view(torch.long).view(2, -1)
            state.buffer.index_copy_(0, state.layout.row_ends.index_select(0, rows), carry[0].index_select(0, index))
        self.num_replays += 1
        self.num_tails += 1
        run = lambda: (self._run(state), tail.run(self._out[:bucket.tokens]))
        if self.capture is None:
            run()
        elif tail.replay is None:
            self._capture_tail(state, tail, run)
        else:
            tail.replay()
        return tail.out

    def _state(self, bucket: Bucket) -> _BucketState:
        state = self._states.get(bucket)
        if state is None:
            state = self._states[bucket] = _BucketState(bucket, self.spare_slot, self.device)
        return state

    def _stage(self, state: _BucketState, slots, starts, tokens, parents, extra: torch.Tensor) -> torch.Tensor:
        """One host-to-device copy of the bucket's inputs and then `extra`'s bytes (the real rows' logits
        index, or a tail's inputs); the bucket's buffer filled from it. Returns the staged bytes (uint8)."""
        bucket = state.bucket
        rows, q = bucket.rows, bucket.q
        pad_rows = rows - len(slots)
        ids, positions, write_pos, bits = [], [], [], []
        for b, (start, row) in enumerate(zip(starts, tokens)):
            ids += row + [row[-1]] * (q - len(row))
            tree = parents[b] if parents is not None else None
            offsets = [0] + depths(tree) if tree is not None else []
            positions += [start + (offsets[i] if i < len(offsets) else i) for i in range(q)]
            write_pos += range(start, start + q)
            own = visible_inputs(tree) if tree is not None else []
            bits += own + [-1] * (q - len(own))
        ids += [0] * (pad_rows * q)
        positions += list(range(q)) * pad_rows
        row_ends = [b * q + len(row) - 1 for b, row in enumerate(tokens)] + [b * q + q - 1 for b in range(len(tokens), rows)]
        table = (slots + [self.spare_slot] * pad_rows + starts + [0] * pad_rows + [q] * rows
                 + [b * q for b in range(rows)])
        tree_part = write_pos + list(range(q)) * pad_rows + bits + [-1] * (pad_rows * q) if bucket.tree else []
        host = torch.tensor(ids + table + positions + row_ends + tree_part, dtype=torch.long)
        staged = torch.cat([host.view(torch.uint8), extra.view(torch.uint8)])
        if self.device.type == "cuda":    # from pinned memory the copy waits for nothing the stream runs
            staged = staged.pin_memory().to(self.device, non_blocking=True)
        else:
            staged = staged.to(self.device)
        state.buffer.copy_(staged[:8 * state.buffer.numel()].view(torch.long))
        return staged

    def _run(self, state: _BucketState) -> None:
        """The bucket's forward on its static buffers; its logits into the shared output buffer."""
        lay = state.layout
        if self.flex_tables is not None:
            lay.flex, mask = self.flex_tables(lay), None
        else:
            lay.flex = None
            mask, _ = attention_masks(lay, self.num_groups, self.dtype)
        keep = 0 if state.bucket.logits == "all" else lay.row_ends
        logits = self.forward_fn(lay, mask, keep)                              # [kept, vocab]
        if self._out is None:
            self._out = torch.empty(MAX_TOKENS, logits.shape[-1], dtype=logits.dtype, device=self.device)
        self._out[:logits.shape[0]].copy_(logits)

    def _real(self, bucket: Bucket, real_idx: torch.Tensor) -> torch.Tensor:
        return self._out[:bucket.tokens if bucket.logits == "all" else bucket.rows].index_select(0, real_idx)

    def _capture(self, state: _BucketState, real_idx: torch.Tensor) -> torch.Tensor:
        """First use of a bucket: run it uncaptured (the reference, and the warm-up, on a side stream),
        capture it, replay it, and keep the graph only if the replay reproduces the reference."""
        t0 = time.perf_counter()
        try:
            return self._capture_checked(state, real_idx)
        finally:
            self.capture_s += time.perf_counter() - t0

    def _capture_checked(self, state: _BucketState, real_idx: torch.Tensor) -> torch.Tensor:
        self.capture.warm_up(lambda: self._run(state))
        reference = self._real(state.bucket, real_idx).clone()
        self._out.fill_(float("nan"))      # the replay must write every real row itself
        try:
            replay = self.capture.capture(lambda: self._run(state))
            replay()
        except Exception as exc:           # any failure to capture: eager from now on, never a wrong result
            self._fail(f"capturing {state.bucket} raised {type(exc).__name__}: {exc}", self._disable)
            return reference
        replayed = self._real(state.bucket, real_idx)
        if not _replays(replayed, reference):
            self._fail(f"the replay of {state.bucket} differs from its uncaptured run", self._disable)
            return reference
        state.replay = replay
        return replayed

    def _capture_tail(self, state: _BucketState, tail, run: Callable[[], None]) -> None:
        """First use of a (bucket, tail): as _capture, the forward and the tail as one graph, kept only
        if its replay gives the uncaptured run's logits (as _capture_checked) and exactly its output.
        A failure turns tails off (the forward's graphs stay) and leaves the uncaptured run's output."""
        t0 = time.perf_counter()
        try:
            self.capture.warm_up(run)
            reference, logits = tail.out.clone(), self._out[:state.bucket.tokens].clone()
            self._out.fill_(float("nan"))
            tail.out.fill_(-2)
            try:
                replay = self.capture.capture(run)
                replay()
            except Exception as exc:       # tails off, never a wrong result
                self._fail(f"capturing {state.bucket} with its tail raised {type(exc).__name__}: {exc}",
                           self._disable_tails)
                tail.out.copy_(reference)
                return
            if not (torch.equal(tail.out, reference) and _replays(self._out[:state.bucket.tokens], logits)):
                self._fail(f"the replay of {state.bucket} with its tail differs from its uncaptured run",
                           self._disable_tails)
                tail.out.copy_(reference)
                return
            tail.replay = replay
        finally:
            self.capture_s += time.perf_counter() - t0

    def _fail(self, reason: str, otherwise: Callable[[str], None]) -> None:
        """A capture failed: attention by lengths off where it was on (every graph so far dropped, the
        padded path captured next), else `otherwise(reason)`."""
        if self.flex_tables is None:
            otherwise(reason)
            return
        self.flex_tables, self.flex_off_reason = None, reason
        self._states.clear()
        self._tails.clear()
        warnings.warn(f"attention by lengths off in this model's CUDA graphs: {reason}; they take the padded "
                      f"path", RuntimeWarning, stacklevel=4)

    def _disable_tails(self, reason: str) -> None:
        self.tails_enabled, self.tails_disabled_reason = False, reason
        self._tails.clear()
        warnings.warn(f"verification runs after the graph's forward for this model: {reason}", RuntimeWarning,
                      stacklevel=4)

    def _disable(self, reason: str) -> None:
        self.enabled, self.disabled_reason = False, reason
        self._states.clear()
        self._tails.clear()
        warnings.warn(f"CUDA graphs off for this model: {reason}; its steps run eagerly", RuntimeWarning,
                      stacklevel=3)

    @property
    def num_graphs(self) -> int:
        return (sum(s.replay is not None for s in self._states.values())
                + sum(t.replay is not None for t in self._tails.values()))
