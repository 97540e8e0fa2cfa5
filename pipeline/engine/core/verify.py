"""Verification of draft tokens against the target: pure functions of tensors.

Greedy rule (temperature 0): accept draft token y_i while y_i == argmax p_i; at the first mismatch
emit argmax p_i (the *recovered* token). Sampling rule (Leviathan et al. 2023, Chen et al. 2023):
accept y_i with probability min(1, p_i(y_i) / q_i(y_i)); at the first rejection emit a token from
norm([p_i - q_i]+). For token-only drafts q_i is one-hot on y_i: acceptance is p_i(y_i), and the
residual is p_i with y_i removed, renormalised. When every draft token is accepted a *bonus* token is
drawn from p_{g+1}. Either way the emitted sequence is distributed exactly as the target's.

q comes in one of three forms: None (every draft row one-hot), dense [num_draft_tokens, vocab] (a
draft model's), or `SparseProbs` (a small support per row, as a suffix index's continuation counts
give: COO entries, each row listing at least its own draft token). Only q(y_i) and the rows at a
first rejection are ever read, so a sparse q is never made dense beyond those rows.

Ragged batches are stored flat: sequence b owns draft rows cu_num_draft[b]:cu_num_draft[b+1] and
target rows cu_num_draft[b]+b : cu_num_draft[b+1]+b+1 (its g_b + 1 distributions). Padded batches
(verify_step.py: every sequence given the same number of draft rows, so that shapes stay fixed) pass
each sequence's real count as `num_valid`: rows past it are never accepted, and the final token is
drawn as where the draft ends there.

Grammars (response_format). A constrained row's p_i is the target masked by its grammar at that
position and renormalised; the rule above then gives outputs distributed exactly as that masked
target, for any q the draft tokens were truly drawn from. The drafting side must keep that premise:
  - a draft model's q is masked by the same grammar before it draws (its q is then the masked draft);
  - a one-hot draft (n-gram, suffix's most frequent walk, forced tokens) is a function of the
    prefix: it may end early wherever it likes, so it is cut before the first token the grammar
    forbids; at such a token y the rule would reject surely (p(y) = 0) and draw norm([p - 1_y]+) = p,
    exactly the bonus draw that ending the draft there gives;
  - a token drawn from a spread q that the grammar forbids is kept (dropping it on seeing it would
    make the draft's length depend on the draw): it is rejected surely and the residual
    norm([p - q]+) is drawn, as the proof requires;
  - a forced token (the grammar's only continuation) has p = 1 and is accepted surely; where the
    tokenizer spells the same bytes another way, p is spread over the spellings and the forced token
    is an ordinary one-hot draft.
Masked p rows come in like any other; this module never sees a grammar.

This module knows nothing about models, caches, requests or random generators: all randomness comes
in as uniforms drawn by the caller from each sequence's own generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyOutput:
    num_accepted: torch.Tensor   # [num_seqs] int64: accepted draft tokens per sequence
    output_ids: torch.Tensor     # [num_seqs, max_draft + 1] int64: accepted + recovered/bonus, -1 padded
    is_accepted: torch.Tensor    # [num_draft_tokens] bool: per draft position, accepted or not
                                 # (positions after the first rejection are False; trees: on the accepted path)
    path: torch.Tensor | None = None   # trees (core/verify_tree.py): [num_seqs, max_depth] int64 the
                                       # accepted tokens' indices among the row's draft tokens, -1 padded

    def to_host(self) -> "HostVerifyOutput":
        """The step's one device-to-host readback: the tensors packed into one int64 buffer."""
        num_seqs, width = self.output_ids.shape
        parts = [self.num_accepted.long(), self.output_ids.reshape(-1).long(), self.is_accepted.long()]
        if self.path is not None:
            parts.append(self.path.reshape(-1).long())
        packed = torch.cat(parts).tolist()
        ids = packed[num_seqs:num_seqs + num_seqs * width]
        end = num_seqs + num_seqs * width + len(self.is_accepted)
        path = None
        if self.path is not None:
            depth = self.path.shape[1]
            path = [packed[end + b * depth:end + (b + 1) * depth] for b in range(num_seqs)]
        return HostVerifyOutput(packed[:num_seqs], [ids[b * width:(b + 1) * width] for b in range(num_seqs)],
                                [bool(a) for a in packed[num_seqs + num_seqs * width:end]], path)


@dataclass
class HostVerifyOutput:
    """VerifyOutput as Python lists (after the readback)."""
    num_accepted: list[int]
    output_ids: list[list[int]]
    is_accepted: list[bool]
    path: list[list[int]] | None = None


@dataclass
class SparseProbs:
    """q rows as COO entries: q[row[i], token[i]] = prob[i], zero elsewhere; (row, token) pairs unique."""
    row: torch.Tensor      # [nnz] int64 draft row
    token: torch.Tensor    # [nnz] int64
    prob: torch.Tensor     # [nnz] float

    @classmethod
    def from_lists(cls, rows: list[list[tuple[list[int], list[float]]]], device) -> "SparseProbs":
        """rows[b][i] = (tokens, probs): the support of sequence b's i-th draft row, rows flat in order."""
        row, token, prob, r = [], [], [], 0
        for seq_rows in rows:
            for tokens, probs in seq_rows:
                row += [r] * len(tokens)
                token += tokens
                prob += probs
                r += 1
        return cls(torch.tensor(row, dtype=torch.long, device=device),
                   torch.tensor(token, dtype=torch.long, device=device),
                   torch.tensor(prob, dtype=torch.float32, device=device))

    def to(self, device) -> "SparseProbs":
        return SparseProbs(self.row.to(device), self.token.to(device), self.prob.to(device))

    def at(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """[num_draft_tokens] q(y) of each row's own draft token."""
        hit = self.token == draft_ids[self.row]          # at most one entry per row: (row, token) pairs are unique
        return torch.zeros(len(draft_ids), dtype=self.prob.dtype, device=draft_ids.device).index_put_(
            (self.row,), torch.where(hit, self.prob, 0.0), accumulate=True)

    def dense(self, rows: torch.Tensor, num_draft_tokens: int, vocab: int, dtype) -> torch.Tensor:
        """[len(rows), vocab]: the given draft rows made dense. A row asked for twice is filled once and
        copied; entries of rows not asked for land in a spare row. No shape depends on the values."""
        n = len(rows)
        first = torch.full((num_draft_tokens,), n, dtype=torch.long, device=rows.device).scatter_reduce_(
            0, rows, torch.arange(n, device=rows.device), reduce="amin", include_self=True)
        out = torch.zeros(n + 1, vocab, dtype=dtype, device=rows.device)
        out.index_put_((first[self.row], self.token), self.prob.to(dtype))
        return out[first[rows]]


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform per row. probs [rows, vocab] (need not be normalised),
    uniforms [rows] in [0, 1). Returns [rows] int64. Zero-probability tokens are never drawn."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)                   # [rows, vocab]; the same values as
                                                                      # .to(float64).cumsum, ~3x faster
    target = (uniforms.to(torch.float64) * cdf[:, -1]).unsqueeze(-1)  # [rows, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def _flat_index(cu_num_draft: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each of the `total` draft rows: its sequence, its position within the sequence, its target
    row. `total` comes from a shape the host knows (no read of cu_num_draft[-1] back from the device)."""
    num_draft = cu_num_draft[1:] - cu_num_draft[:-1]                   # [num_seqs]
    seq_of_row = torch.repeat_interleave(torch.arange(len(num_draft), device=cu_num_draft.device), num_draft,
                                         output_size=total)
    pos_in_seq = torch.arange(total, device=cu_num_draft.device) - cu_num_draft[seq_of_row]
    target_row = cu_num_draft[seq_of_row] + seq_of_row + pos_in_seq
    return seq_of_row, pos_in_seq, target_row


def first_rejections(is_accepted: torch.Tensor, cu_num_draft: torch.Tensor) -> torch.Tensor:
    """Per sequence, the number of leading accepted draft tokens. is_accepted [num_draft_tokens]."""
    num_draft = cu_num_draft[1:] - cu_num_draft[:-1]
    seq_of_row, pos_in_seq, _ = _flat_index(cu_num_draft, is_accepted.shape[0])
    # Rejected positions (or g for none): the first one is the accepted prefix length.
    reject_pos = torch.where(is_accepted, num_draft[seq_of_row], pos_in_seq)
    return num_draft.clone().scatter_reduce_(0, seq_of_row, reject_pos, reduce="amin", include_self=True)


def verify(
    draft_ids: torch.Tensor,          # [num_draft_tokens] int64, flat
    cu_num_draft: torch.Tensor,       # [num_seqs + 1] int64 offsets
    target_probs: torch.Tensor,       # [num_draft_tokens + num_seqs, vocab] processed p (rows per seq: g+1)
    draft_probs: "torch.Tensor | SparseProbs | None",  # q: [num_draft_tokens, vocab], sparse, or None (one-hot)
    is_greedy: torch.Tensor,          # [num_seqs] bool
    accept_uniforms: torch.Tensor,    # [num_draft_tokens] in [0, 1)
    sample_uniforms: torch.Tensor,    # [num_seqs] in [0, 1)
    max_draft: int | None = None,     # the longest row's draft length, where the host knows it
    any_greedy: bool | None = None,   # whether is_greedy has a True, where the host knows it
    num_valid: torch.Tensor | None = None,   # [num_seqs] padded batches: each sequence's real draft count
) -> VerifyOutput:
    """Apply the greedy or rejection-sampling rule to every sequence of a ragged batch. With max_draft and
    any_greedy given, nothing is read back from the device: every step below has shapes the host knows."""
    device = target_probs.device
    num_seqs, total = len(cu_num_draft) - 1, draft_ids.shape[0]
    num_draft = cu_num_draft[1:] - cu_num_draft[:-1] if num_valid is None else num_valid    # [num_seqs]
    seq_of_row, pos_in_seq, target_row = _flat_index(cu_num_draft, total)

    p_rows = target_probs[target_row]                                   # [num_draft_tokens, vocab]
    p_y = p_rows.gather(1, draft_ids.unsqueeze(1)).squeeze(1)           # [num_draft_tokens]
    q_y = torch.ones_like(p_y) if draft_probs is None else _q_at(draft_probs, draft_ids).to(p_y.dtype)
    # u < min(1, p/q)  <=>  u * q < p  (q > 0 for a proposed token)
    sampled_accept = accept_uniforms.to(p_y.dtype) * q_y < p_y
    greedy_accept = draft_ids == p_rows.argmax(dim=-1)
    is_accepted = torch.where(is_greedy[seq_of_row], greedy_accept, sampled_accept)
    if num_valid is not None:
        is_accepted &= pos_in_seq < num_valid[seq_of_row]
    num_accepted = first_rejections(is_accepted, cu_num_draft)          # [num_seqs]
    is_accepted &= pos_in_seq < num_accepted[seq_of_row]

    # The final token of each sequence: recovered (at the first rejection) or bonus (all accepted).
    final_row = cu_num_draft[:-1] + torch.arange(num_seqs, device=device) + num_accepted
    # [num_seqs, vocab]; with no draft rows at all (plain decoding) final_row is every row in order
    final_p = target_probs if target_probs.shape[0] == num_seqs else target_probs[final_row]
    final_dist = final_p
    if total:       # a rejection needs a draft: every row's residual, kept where the row rejected
        rejected = num_accepted < num_draft
        rej_draft_row = (cu_num_draft[:-1] + num_accepted).clamp_(max=total - 1)   # rows that rejected: exact
        q_rows = _q_rows(draft_probs, draft_ids, rej_draft_row, final_p.shape[-1], final_p.dtype)
        residual = (final_p - q_rows).clamp_(min=0)
        # p == q exactly makes rejection impossible; guard the 0/0 anyway.
        keep = rejected & (residual.sum(dim=-1) > 0)
        final_dist = torch.where(keep.unsqueeze(1), residual, final_p)
    final_tok = sample_from_probs(final_dist, sample_uniforms)
    if bool(is_greedy.any()) if any_greedy is None else any_greedy:   # no vocabulary-wide argmax where all sample
        final_tok = torch.where(is_greedy, final_p.argmax(dim=-1), final_tok)

    return _assemble(draft_ids, cu_num_draft, is_accepted, num_accepted, final_tok, max_draft)


def verify_greedy(draft_ids: torch.Tensor, cu_num_draft: torch.Tensor, target_argmax: torch.Tensor,
                  max_draft: int | None = None, num_valid: torch.Tensor | None = None) -> VerifyOutput:
    """The greedy rule alone, from the target's argmax per row ([num_draft_tokens + num_seqs]):
    the same result as `verify` with all-greedy sequences, without touching vocabulary-sized rows."""
    device = target_argmax.device
    num_seqs = len(cu_num_draft) - 1
    seq_of_row, pos_in_seq, target_row = _flat_index(cu_num_draft, draft_ids.shape[0])
    is_accepted = draft_ids == target_argmax[target_row]
    if num_valid is not None:
        is_accepted &= pos_in_seq < num_valid[seq_of_row]
    num_accepted = first_rejections(is_accepted, cu_num_draft)
    is_accepted &= pos_in_seq < num_accepted[seq_of_row]
    final_tok = target_argmax[cu_num_draft[:-1] + torch.arange(num_seqs, device=device) + num_accepted]
    return _assemble(draft_ids, cu_num_draft, is_accepted, num_accepted, final_tok, max_draft)


def _assemble(draft_ids, cu_num_draft, is_accepted, num_accepted, final_tok, max_draft: int | None) -> VerifyOutput:
    """Per sequence: its accepted draft tokens (its leading ones), then the recovered/bonus token; -1 padded
    to max_draft + 1 (read from the device only where the caller does not know it)."""
    num_seqs, total = len(cu_num_draft) - 1, draft_ids.shape[0]
    if max_draft is None:
        max_draft = int((cu_num_draft[1:] - cu_num_draft[:-1]).max()) if num_seqs else 0
    device = draft_ids.device
    col = torch.arange(max_draft + 1, device=device).unsqueeze(0)                  # [1, max_draft + 1]
    k = num_accepted.unsqueeze(1)
    output_ids = torch.full((num_seqs, max_draft + 1), -1, dtype=torch.long, device=device)
    if total:
        drafted = draft_ids[(cu_num_draft[:-1].unsqueeze(1) + col).clamp_(max=total - 1)]
        output_ids = torch.where(col < k, drafted, output_ids)
    output_ids = torch.where(col == k, final_tok.unsqueeze(1), output_ids)
    return VerifyOutput(num_accepted=num_accepted, output_ids=output_ids, is_accepted=is_accepted)


def _q_at(draft_probs, draft_ids) -> torch.Tensor:
    if isinstance(draft_probs, SparseProbs):
        return draft_probs.at(draft_ids)
    return draft_probs.gather(1, draft_ids.unsqueeze(1)).squeeze(1)


def _q_rows(draft_probs, draft_ids, rows, vocab, dtype) -> torch.Tensor:
    """q for the given draft rows as dense [len(rows), vocab] (one-hot rows built on the fly)."""
    if isinstance(draft_probs, SparseProbs):
        return draft_probs.dense(rows, len(draft_ids), vocab, dtype)
    if draft_probs is not None:
        return draft_probs[rows].to(dtype)
    dense = torch.zeros(len(rows), vocab, dtype=dtype, device=draft_ids.device)
    dense[torch.arange(len(rows), device=draft_ids.device), draft_ids[rows]] = 1.0
    return dense
