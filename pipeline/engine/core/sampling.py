"""From raw logits to the distributions actually sampled from: pure tensor functions.

The same function produces the target's p and the draft's q, row by row, so both are processed
identically (the precondition of lossless verification). Order, as in Hugging Face `generate` with
a grammar's logits processor first: penalties on raw logits -> grammar mask (forbidden tokens to
-inf) -> temperature -> top-k -> top-p -> min-p -> softmax. The filters thus act on the masked
distribution: top-k keeps the k most likely *allowed* tokens.

Penalties (vLLM semantics): repetition over prompt + output tokens (divide positive logits, multiply
negative ones), presence and frequency over output tokens only. History-dependent quantities are
computed per row on that row's own candidate prefix (h + y_<i), which the caller passes as counts.

Greedy rows (temperature 0) come back one-hot on the argmax of their penalised logits: the
temperature-0 limit, which makes the verifier's greedy rule and its argmax exact.

`row_probs` is the entry point for the engine and the draft-model drafter: it reads a row's sampling
params and token history (prompt_ids, output_ids) and nothing else of a sequence.

This module knows nothing about models, KV or randomness.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import SamplingParams, Sequence


@dataclass
class RowParams:
    """Sampling parameters per logits row; [rows] tensors."""
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    is_greedy: torch.Tensor
    has_filters: bool
    has_penalties: bool
    any_greedy: bool                 # host-side: some row is greedy (no device read to know)
    top_ks: tuple[int, ...] = ()     # host-side: each row's top_k, so the filters read nothing back
    any_top_p: bool = False          # host-side: some row has top_p < 1
    any_min_p: bool = False          # host-side: some row has min_p > 0
    top_k_width: int | None = None   # host-side, where a fixed-shape step fixes it: the top-k width (at
                                     # least every row's k; 0: no row keeps only its top k); None: from top_ks

    COLUMNS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty")

    @classmethod
    def from_params(cls, params: list[SamplingParams], device) -> "RowParams":
        """One host-to-device copy for every column. top_k travels as float32: exact below 2**24, and
        any larger value means what it did (more than the vocabulary: off)."""
        cols = torch.tensor([[getattr(p, c) for c in cls.COLUMNS] for p in params],
                            dtype=torch.float32).to(device).T
        return cls(
            temperature=cols[0], top_k=cols[1].long(), top_p=cols[2], min_p=cols[3],
            repetition_penalty=cols[4], presence_penalty=cols[5], frequency_penalty=cols[6],
            is_greedy=cols[0] == 0,
            has_filters=any(p.has_filters and not p.is_greedy for p in params),
            has_penalties=any(p.has_penalties for p in params),
            any_greedy=any(p.is_greedy for p in params),
            top_ks=tuple(p.top_k for p in params),
            any_top_p=any(p.top_p < 1 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
        )

    @classmethod
    def from_columns(cls, cols: torch.Tensor, *, any_greedy: bool, top_k_width: int, any_top_p: bool,
                     any_min_p: bool, penalties: bool = False) -> "RowParams":
        """From [len(COLUMNS), rows] float32 columns already on the device, with the host-side facts
        given (a fixed-shape step's: core/verify_step.py)."""
        return cls(
            temperature=cols[0], top_k=cols[1].long(), top_p=cols[2], min_p=cols[3],
            repetition_penalty=cols[4], presence_penalty=cols[5], frequency_penalty=cols[6],
            is_greedy=cols[0] == 0, has_filters=bool(top_k_width or any_top_p or any_min_p),
            has_penalties=penalties, any_greedy=any_greedy, any_top_p=any_top_p, any_min_p=any_min_p,
            top_k_width=top_k_width)

    def width(self, vocab: int) -> int:
        """The top-k width the filters take (0: no row keeps only its top k)."""
        if self.top_k_width is not None:
            return min(self.top_k_width, vocab)
        return top_k_width(self.top_ks, vocab)


def top_k_width(top_ks, vocab: int) -> int:
    """The top-k width that serves every row (a row without top-k counts as the whole vocabulary), or 0
    where no row keeps only its top k."""
    ks = [min(k, vocab) if k > 0 else vocab for k in top_ks]
    return max(ks) if any(k < vocab for k in ks) else 0


def token_counts(histories: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[rows, vocab] float32 counts of each row's token history, counted on the device: only the
    [rows, longest history] index travels, not a dense [rows, vocab] host tensor."""
    width = max((len(h) for h in histories), default=0) + 1
    idx = torch.tensor([h + [vocab] * (width - len(h)) for h in histories], dtype=torch.long).to(device)
    counts = torch.zeros(len(histories), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, idx, torch.ones(idx.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rp: RowParams, output_counts: torch.Tensor,
                    prompt_counts: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] float32; counts [rows, vocab]. Returns new logits."""
    seen = (output_counts > 0) | (prompt_counts > 0)
    rep = rp.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - rp.frequency_penalty.unsqueeze(1) * output_counts
    return logits - rp.presence_penalty.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def _filter(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """top-k, top-p, min-p on temperature-scaled logits [rows, vocab]; removed tokens -> -inf."""
    neg_inf = torch.tensor(float("-inf"), device=logits.device)
    vocab = logits.shape[-1]
    width = rp.width(vocab)                                           # the host's bound on k below
    if width:
        k = torch.where(rp.top_k > 0, rp.top_k.clamp(max=vocab), torch.full_like(rp.top_k, vocab))
        kth = logits.topk(width, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        logits = torch.where(logits < kth, neg_inf, logits)
    if rp.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= rp.top_p.unsqueeze(1)   # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits = torch.where(drop, neg_inf, logits)
    if rp.any_min_p:
        probs = logits.softmax(dim=-1)
        floor = rp.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = torch.where(probs < floor, neg_inf, logits)
    return logits


def bitmask_to_bool(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bit masks (bit t % 32 of word t // 32 allows token t) -> [rows, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed[:, :vocab]


def _apply_bitmask_torch(logits: torch.Tensor, bits: torch.Tensor) -> None:
    logits.masked_fill_(~bitmask_to_bool(bits, logits.shape[-1]), float("-inf"))


_bitmask_kernel = None


def apply_bitmask_(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """Forbidden tokens of float32 logits [rows, vocab] to -inf, in place; bits [rows, words] int32
    on the logits' device. The kernel is llguidance's (compiled by inductor on first use, ~5 s on
    CPU, one pass over the rows: ~0.15 ms for 32 x 49,152 where masked_fill takes ~4 ms); where
    it cannot compile, the same result in plain torch."""
    global _bitmask_kernel
    if _bitmask_kernel is None:
        try:
            from llguidance.torch import apply_token_bitmask_inplace
            probe = torch.zeros(1, 64, device=logits.device)
            apply_token_bitmask_inplace(probe, torch.tensor([[1, 0]], dtype=torch.int32, device=logits.device))
            if not (probe[0, 0] == 0 and torch.isinf(probe[0, 1:]).all()):
                raise RuntimeError("the kernel's result differs from the definition")
            _bitmask_kernel = apply_token_bitmask_inplace
        except Exception:  # noqa: BLE001 -- no compiler, no triton: the plain path is exact too
            _bitmask_kernel = _apply_bitmask_torch
    _bitmask_kernel(logits, bits)


def _masked(logits: torch.Tensor, allowed: torch.Tensor | None, source: torch.Tensor) -> torch.Tensor:
    """Forbidden tokens (allowed: [rows, words] int32 bit masks) to -inf; `source` (the caller's
    logits) is never written."""
    if allowed is None:
        return logits
    if logits.data_ptr() == source.data_ptr():
        logits = logits.clone()
    apply_bitmask_(logits, allowed)
    return logits


def greedy_tokens(logits: torch.Tensor, rp: RowParams, output_counts: torch.Tensor | None = None,
                  prompt_counts: torch.Tensor | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """[rows] argmax of the penalised, masked logits: what greedy rows of processed_probs are one-hot on."""
    source, logits = logits, logits.float()
    if rp.has_penalties:
        logits = apply_penalties(logits, rp, output_counts, prompt_counts)
    return _masked(logits, allowed, source).argmax(dim=-1)


def processed_probs(logits: torch.Tensor, rp: RowParams, output_counts: torch.Tensor | None = None,
                    prompt_counts: torch.Tensor | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, vocab] (any float dtype) -> probabilities [rows, vocab] float32. `allowed`
    [rows, words] int32: the rows' grammar bit masks (None: every token allowed)."""
    source, logits = logits, logits.float()
    if rp.has_penalties:
        logits = apply_penalties(logits, rp, output_counts, prompt_counts)
    logits = _masked(logits, allowed, source)
    greedy_choice = logits.argmax(dim=-1) if rp.any_greedy else None      # [rows]
    temp = torch.where(rp.is_greedy, torch.ones_like(rp.temperature), rp.temperature)
    logits = logits / temp.unsqueeze(1)
    if rp.has_filters:
        logits = _filter(logits, rp)
    probs = logits.softmax(dim=-1)
    if rp.any_greedy:
        onehot = torch.zeros_like(probs).scatter_(1, greedy_choice.unsqueeze(1), 1.0)
        probs = torch.where(rp.is_greedy.unsqueeze(1), onehot, probs)
    return probs


def penalty_counts(seqs: list[Sequence], extra: list[list[int]], vocab: int,
                   device) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and prompt token counts ([rows, vocab] each) for rows whose history is
    seq.output_ids + extra[r]."""
    outputs = [s.output_ids + e for s, e in zip(seqs, extra)]
    return token_counts(outputs, vocab, device), token_counts([s.prompt_ids for s in seqs], vocab, device)


def row_probs(logits: torch.Tensor, seqs: list[Sequence], extra: list[list[int]],
              argmax_only: bool = False, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Processed distributions for rows (seqs[r] with candidate suffix extra[r]): [rows, vocab];
    with argmax_only, just their greedy choice: [rows]. `allowed`: the rows' grammar masks."""
    rp = RowParams.from_params([s.params for s in seqs], logits.device)
    counts = penalty_counts(seqs, extra, logits.shape[-1], logits.device) if rp.has_penalties else (None, None)
    return (greedy_tokens if argmax_only else processed_probs)(logits, rp, *counts, allowed=allowed)
