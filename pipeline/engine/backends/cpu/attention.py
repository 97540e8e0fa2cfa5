"""Attention on CPU: our C kernel over the slot store (csrc/slot_attention.c).

Why a kernel of our own: on a CPU a decoding step's attention is a few query rows per sequence
against that sequence's keys. Torch's SDPA kernel runs it as many tiny GEMMs over keys padded to the
step's longest row, and reached ~10 GB/s of a 30-40 GB/s memory system here (bench/RESULTS.md,
"CPU kernels"); FlexAttention removes the padding but costs more per key on CPU. The C
kernel streams each row's own keys once per KV head for all the query heads that share it, with
no mask and no padding, so a step costs what its rows' lengths cost. Measured on prompt prefill
too (causal rows of 100-2000 tokens) it beat padded SDPA by 5-15%, so it takes every forward.

It is built with the system C compiler the first time a runner asks for it (build.py: about
a second, then cached per source, compiler and CPU) and checked against a torch reference before
first use. Where any of that fails,
`unavailable()` says why and the runner keeps torch's kernels.

Rows of many new tokens (prompt chunks, verify rows) are bound by the products, not the memory: on CPUs
with AMX, our AMX kernel (csrc/amx_attention_bf16.c) multiplies bf16 queries, keys and softmax
numerators in tiles. On an Intel Xeon with AMX, bf16, SmolLM2's 30 layers, 2 threads, ms (bench/RESULTS.md,
"CPU kernels"): a 2048-token prefill chunk of 8 prompts 51 against ours' 218; 32 verify rows of 5 tokens at ~300
context 25 against 64; a decoding step (one token a row) 49 against 33, so those rows stay with ours.
Torch's flash attention (SDPA) may serve long rows where there is no AMX: a 256-token prompt row took
0.52 ms there against 1.19 ms here in bf16, while in fp32 ours won at every length. `RowAttention` sends
the rows of at least `long_from` new tokens to the one of them calibrate.py measured faster on the
machine, and the rest to ours.

Scope: fp32 or bf16 stores (a bf16 model's: keys and values are widened to fp32 as they are read,
or, on CPUs with AVX512_BF16, a decoding step's scores taken straight from the bf16 keys by the
dot-product instruction; the queries and the output converted around the call; fp32 accumulation
either way), head sizes
that are multiples of 8 up to 256 (64 and 128 get unrolled loops). Elsewhere (CUDA, float16) the
runner keeps torch's kernels (backends/flex.py, model/attention.py).

This module knows nothing about models or requests: it sees tensors and a row table.
"""
from __future__ import annotations

import ctypes
import itertools
from functools import lru_cache
from pathlib import Path

import torch

from ...core.tree import visible_inputs
from ...kv.layout import visible
from .build import choose, load_checked, loaded

SOURCE = Path(__file__).parent / "csrc" / "slot_attention.c"
SOURCE_AMX = Path(__file__).parent / "csrc" / "amx_attention_bf16.c"       # CPUs with amx_bf16: many-token rows
AMX_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16")     # what amx_*_bf16.c's #error checks
FUNCTIONS = {torch.float32: "slot_attention_f32", torch.bfloat16: "slot_attention_bf16kv"}   # per store dtype
STORE_DTYPES = tuple(FUNCTIONS)



class CpuAttention:
    """The loaded kernel. Call it with packed queries, the layer's slot store and the step's row table."""

    def __init__(self, path: Path):
        self.build = path.stem                          # the source's, compiler's and CPU's build (build.py)
        self._lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fns = {}
        for dtype, name in FUNCTIONS.items():
            fn = getattr(self._lib, name)
            fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn

    def __call__(self, query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                 row_table: torch.Tensor, scale: float, bits: torch.Tensor | None = None,
                 check: bool = True) -> torch.Tensor:
        """query [num_tokens, heads, dim]; k_store/v_store [num_slots, kv_heads, cap, dim] fp32 or
        bf16; row_table [4, rows] int64 (slot, start, num_new, first packed token per row). Returns
        the attention output [num_tokens, heads, dim] in the query's dtype (computed in fp32). Row
        r's token i (position start + i) sees keys 0 .. start + i of its slot; those must already
        hold this step's keys. bits [num_tokens] int64 (token trees, kv/layout.py's TreeRows): of
        the keys start .. start + 62 a token sees only those whose bit (key - start) is set.
        check=False: the caller has checked arguments of the same dtypes and strides (the decoder
        loop, once per forward for all its layers)."""
        fn = self._fns.get(k_store.dtype)
        if fn is None or v_store.dtype != k_store.dtype:
            raise ValueError(f"cpu attention: stores {k_store.dtype} / {v_store.dtype}: expected both fp32 or bf16")
        q32 = query.float().contiguous()
        num_slots, kv_heads, cap, dim = k_store.shape
        heads = query.shape[1]
        if check:
            for t in (k_store, v_store, row_table) + ((bits,) if bits is not None else ()):
                if not t.is_contiguous():
                    raise ValueError("cpu attention: store, row table and bits must be contiguous")
            if bits is not None and (bits.dtype != torch.long or bits.shape != (query.shape[0],)):
                raise ValueError(f"cpu attention: bits {tuple(bits.shape)} {bits.dtype}: expected [num_tokens] int64")
        out = torch.empty_like(q32)
        status = fn(q32.data_ptr(), k_store.data_ptr(), v_store.data_ptr(), out.data_ptr(),
                    row_table.data_ptr(), None if bits is None else bits.data_ptr(), row_table.shape[1],
                    kv_heads, heads // kv_heads, cap, dim,
                    float(scale), torch.get_num_threads())
        if status != 0:
            raise MemoryError("cpu attention: the kernel could not allocate its scratch memory"
                              if status == -1 else f"cpu attention: kernel status {status}")
        return out.to(query.dtype)


class AmxAttention:
    """The loaded AMX kernel for rows of several new tokens (csrc/amx_attention_bf16.c): bf16 queries and
    stores, causal rows and token trees, P rounded to bf16 before its product with the values (as flash
    attention in bf16)."""

    def __init__(self, path: Path):
        self.build = path.stem
        self._lib = ctypes.CDLL(str(path))
        if self._lib.amx_attention_enable() != 0:
            raise RuntimeError("the kernel may not use AMX tiles here (arch_prctl ARCH_REQ_XCOMP_PERM refused)")
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = self._lib.amx_attention_bf16
        self._fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        self._fn.restype = ctypes.c_int

    def into(self, out: torch.Tensor, query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
             row_table: torch.Tensor, scale: float, bits: torch.Tensor | None = None) -> torch.Tensor:
        """The attention of the table's rows (CpuAttention's arguments) written into their tokens of `out`,
        [num_tokens, heads, dim] bf16 like `query`; out's other tokens are left as they are."""
        tensors = (query, k_store, v_store, out)
        if any(t.dtype != torch.bfloat16 for t in tensors) or not all(
                t.is_contiguous() for t in (*tensors, row_table)) or out.shape != query.shape:
            raise ValueError("amx attention: contiguous bf16 query, stores and output of the query's shape expected")
        if bits is not None and (bits.dtype != torch.long or bits.shape != (query.shape[0],) or not bits.is_contiguous()):
            raise ValueError(f"amx attention: bits {tuple(bits.shape)} {bits.dtype}: expected [num_tokens] int64")
        num_slots, kv_heads, cap, dim = k_store.shape
        status = self._fn(query.data_ptr(), k_store.data_ptr(), v_store.data_ptr(), out.data_ptr(),
                          row_table.data_ptr(), None if bits is None else bits.data_ptr(), row_table.shape[1],
                          kv_heads, query.shape[1] // kv_heads, cap, dim, float(scale), torch.get_num_threads())
        if status != 0:
            raise MemoryError("amx attention: the kernel could not allocate its scratch memory"
                              if status == -1 else f"amx attention: kernel status {status}")
        return out

    def __call__(self, query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                 row_table: torch.Tensor, scale: float, bits: torch.Tensor | None = None) -> torch.Tensor:
        return self.into(torch.empty_like(query), query, k_store, v_store, row_table, scale, bits)


class RowAttention:
    """Our kernel for rows of fewer than `long_from` new tokens; the longer rows by our AMX kernel where
    given (one call for all of them, token trees too), else by torch's SDPA (flash attention on CPU), one
    call per row over its own keys (a step with a token tree stays with ours). The same call as
    CpuAttention's."""

    def __init__(self, kernel: CpuAttention, long_from: int, amx: AmxAttention | None = None):
        self.kernel, self.long_from, self.amx = kernel, long_from, amx
        self._split: tuple[torch.Tensor, list[tuple], torch.Tensor | None, torch.Tensor | None] | None = None

    @property
    def long_kind(self) -> str:
        return "amx" if self.amx is not None else "sdpa"

    def __deepcopy__(self, memo):                       # shared kernels; the split is rebuilt per table
        return RowAttention(self.kernel, self.long_from, self.amx)

    def _rows(self, row_table: torch.Tensor) -> tuple[list[tuple], torch.Tensor | None, torch.Tensor | None]:
        """(the long rows as (slot, start, n, first, mask), the short rows' table or None, the long rows'
        table or None), made once per row table: a forward asks once per layer with the same table (held
        here, so its identity is not reused). mask: a row continuing its prompt (start > 0) sees its
        earlier keys and its own causally (SDPA's rows only)."""
        if self._split is None or self._split[0] is not row_table:
            is_long = row_table[2] >= self.long_from
            long_table = row_table[:, is_long].contiguous() if bool(is_long.any()) else None
            long = [] if long_table is None or self.amx is not None else [
                (slot, start, n, first, None if start == 0 else torch.ones(n, start + n, dtype=torch.bool).tril(start))
                for slot, start, n, first in long_table.T.tolist()]
            short = (row_table if long_table is None else None if bool(is_long.all())
                     else row_table[:, ~is_long].contiguous())
            self._split = (row_table, long, short, long_table)
        return self._split[1], self._split[2], self._split[3]

    def __call__(self, query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                 row_table: torch.Tensor, scale: float, bits: torch.Tensor | None = None,
                 check: bool = True) -> torch.Tensor:
        if bits is not None and self.amx is None:         # token trees: verify rows, ours only
            return self.kernel(query, k_store, v_store, row_table, scale, bits, check)
        long, short, long_table = self._rows(row_table)
        if long_table is None:
            return self.kernel(query, k_store, v_store, row_table, scale, bits, check)
        if self.amx is not None:                          # bf16 out: the queries are bf16 values (fused.py)
            q16 = query.to(torch.bfloat16).contiguous()
            out = (self.kernel(query, k_store, v_store, short, scale, bits).to(torch.bfloat16) if short is not None
                   else torch.empty_like(q16))
            return self.amx.into(out, q16, k_store, v_store, long_table, scale, bits)
        out = (self.kernel(query, k_store, v_store, short, scale, bits) if short is not None
               else torch.empty_like(query))
        for slot, start, n, first, mask in long:
            q = query[first:first + n].transpose(0, 1).unsqueeze(0)                       # [1, heads, n, dim]
            k, v = k_store[slot, :, :start + n].unsqueeze(0), v_store[slot, :, :start + n].unsqueeze(0)
            if q.dtype != k.dtype:
                q = q.to(k.dtype)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=start == 0,
                                                                 scale=scale, enable_gqa=True)
            out[first:first + n] = a[0].transpose(0, 1).to(out.dtype)
        return out


def reference(query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, row_table: torch.Tensor,
              scale: float, bits: torch.Tensor | None = None, rounded_p: bool = False) -> torch.Tensor:
    """The same attention in plain torch, one row at a time (the kernels' specification and check),
    in fp32 whatever the store's dtype, returned in the query's. rounded_p: the AMX kernel's arithmetic,
    the softmax numerators e^(s - max) rounded to bf16 before their product with the values, which is
    divided by their fp32 sum."""
    out_dtype, query = query.dtype, query.float()
    k_store, v_store = k_store.float(), v_store.float()
    out = torch.empty_like(query)
    groups = query.shape[1] // k_store.shape[1]
    for slot, start, n, first in row_table.T.tolist():
        k = k_store[slot, :, :start + n].repeat_interleave(groups, 0)          # [heads, len, dim]
        v = v_store[slot, :, :start + n].repeat_interleave(groups, 0)
        q = query[first:first + n].transpose(0, 1)                             # [heads, n, dim]
        scores = (q @ k.transpose(1, 2)) * scale                               # [heads, n, len]
        future = torch.arange(start + n) > (start + torch.arange(n)).unsqueeze(1)       # [n, len]
        if bits is not None:
            future |= ~visible(torch.arange(start + n), start + torch.arange(n).unsqueeze(1), torch.tensor(start),
                               bits[first:first + n].unsqueeze(1))
        scores = scores.masked_fill(future, float("-inf"))
        if rounded_p:
            e = (scores - scores.amax(-1, keepdim=True)).exp()
            a = (e.bfloat16().float() @ v) / e.sum(-1, keepdim=True)
        else:
            a = scores.softmax(-1) @ v
        out[first:first + n] = a.transpose(0, 1)
    return out.to(out_dtype)


def _self_check(kernel: CpuAttention) -> None:
    """The built kernel against `reference` on ragged rows, non-contiguous slots, both head sizes,
    fp32 and bf16 stores."""
    gen = torch.Generator().manual_seed(0)
    for (dim, groups), dtype in itertools.product(((64, 3), (128, 1), (16, 2)), STORE_DTYPES):
        k_store = torch.randn(5, 2, 48, dim, generator=gen).to(dtype)
        v_store = torch.randn(5, 2, 48, dim, generator=gen).to(dtype)
        slots, starts, num_new = [3, 0, 4], [0, 17, 40], [5, 1, 3]
        firsts = [0, 5, 6]
        table = torch.tensor([slots, starts, num_new, firsts], dtype=torch.long)
        query = torch.randn(sum(num_new), 2 * groups, dim, generator=gen)
        # the first row a token tree (root, 0 <- root, 1 <- root, 2 <- 0, 3 <- 2): masked by its bits
        tree = torch.tensor(visible_inputs([-1, -1, 0, 2]) + [-1] * 4, dtype=torch.long)
        for bits in (None, tree):
            got = kernel(query, k_store, v_store, table, dim ** -0.5, bits)
            want = reference(query, k_store, v_store, table, dim ** -0.5, bits)
            err = (got - want).abs().max().item()
            if not err < 1e-4:
                raise RuntimeError(f"self-check failed: max difference {err:.2e} from the torch reference")


def _self_check_amx(kernel: AmxAttention) -> None:
    """The built AMX kernel against `reference` with the numerators rounded alike: ragged prompt rows, a
    row continuing its prompt, a token tree, head sizes 64, 128 and 32. A bf16 output may differ from the
    reference's by its last bit where the two land either side of a rounding; beyond that they agree."""
    gen = torch.Generator().manual_seed(0)
    for dim, groups in ((64, 3), (128, 1), (32, 2)):
        k_store = torch.randn(5, 2, 160, dim, generator=gen).bfloat16()
        v_store = torch.randn(5, 2, 160, dim, generator=gen).bfloat16()
        table = torch.tensor([[3, 0, 4, 1], [0, 17, 40, 90], [37, 1, 5, 40], [0, 37, 38, 43]], dtype=torch.long)
        query = torch.randn(83, 2 * groups, dim, generator=gen).bfloat16()
        bits = torch.full((83,), -1, dtype=torch.long)
        bits[38:43] = torch.tensor(visible_inputs([-1, -1, 0, 2]))          # the row of 5 at 40: a tree
        for b in (None, bits):
            got = kernel(query, k_store, v_store, table, dim ** -0.5, b).float()
            want = reference(query, k_store, v_store, table, dim ** -0.5, b, rounded_p=True).float()
            err = ((got - want).abs() / (want.abs() + 1e-2)).max().item()
            if not err < 2 ** -6:
                raise RuntimeError(f"self-check failed: relative difference {err:.2e} from the torch reference")


@lru_cache(maxsize=None)
def _load_amx() -> tuple[AmxAttention | None, str | None]:
    return load_checked(SOURCE_AMX, AmxAttention, _self_check_amx, "the attention kernel without AMX tiles",
                        needs=AMX_FLAGS)


def amx_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why a runner with this device, store dtype and head size cannot use the AMX kernel, else None.
    Builds (or finds) and checks it on first call: CPUs with amx_bf16, bf16 stores, head sizes that are
    multiples of 32 up to 256."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return "the AMX attention kernel is for bf16 stores on CPUs"
    if head_dim % 32 or head_dim > 256:
        return f"head size {head_dim}: the AMX kernel takes multiples of 32 up to 256"
    return _load_amx()[1]


def amx_kernel() -> AmxAttention:
    return loaded(_load_amx, "AMX attention kernel")


@lru_cache(maxsize=None)
def _load() -> tuple[CpuAttention | None, str | None]:
    return load_checked(SOURCE, CpuAttention, _self_check, "torch's attention kernels")


def unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why a runner with this device, store dtype and head size cannot use the kernel, else None.
    Builds (or finds) and checks the kernel on first call."""
    if device.type != "cpu":
        return f"device {device.type}: the kernel is for CPUs"
    if dtype not in STORE_DTYPES:
        return f"store dtype {dtype}: the kernel takes fp32 or bf16 stores"
    if head_dim % 8 or head_dim > 256:
        return f"head size {head_dim}: the kernel takes multiples of 8 up to 256"
    return _load()[1]


def kernel() -> CpuAttention:
    return loaded(_load, "cpu attention kernel")


def policy(mode: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> CpuAttention | None:
    """The kernel a runner uses under its switch cpu_attention = mode: auto (where
    it is available), on (raises where not), off (None: torch's kernels)."""
    return choose("cpu_attention", mode, lambda: unavailable(device, dtype, head_dim), kernel)
