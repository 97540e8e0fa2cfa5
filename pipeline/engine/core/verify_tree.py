"""Verification of token trees (core/tree.py): several candidate continuations per row, checked by
one target forward. Pure functions of tensors, like verify.py, whose single-path rule is the special
case of a tree whose every token has one child.

Flat layout: sequence b owns draft tokens cu_num_draft[b]:cu_num_draft[b+1] (its tree, `parents`
row-local) and target rows base_b = cu_num_draft[b] + b ... base_b + g_b: row base_b is p after the
committed text (the root), row base_b + 1 + i is p after draft token i's path (the forward's input
i + 1). A draft token is judged against its parent's row.

Greedy rule: accept the deepest path whose every token is the target's argmax after its parent;
then emit the argmax after that path (recovered, or bonus at a leaf).

Sampling rule (multi-candidate speculative sampling: SpecInfer, Miao et al. 2024; Sequoia, Chen et
al. 2024): start at the root with r = p_root. Try the node's children c_1, c_2, ... in index order:
child c (token x, drawn from q_c) is accepted with probability min(1, r(x) / q_c(x)), r normalised;
the walk then moves to c with r = p after c. On rejection r <- norm([r - q_c]+) and the next sibling
is tried. When no child is left to try, the final token is drawn from r (recovered where a child was
rejected, bonus where the node has no children).

Why the output is distributed exactly as the target's. One try is a speculative sampling step of
draft q_c against target r: its outcome, "x" on acceptance or a draw from norm([r - q_c]+) on
rejection, is distributed as r for any q_c the token truly came from (Leviathan et al. 2023). Trying
the next sibling against that residual instead of drawing from it is again such a step, now with the
residual as its target, so its outcome is distributed as the residual whatever the sibling's q is
(it may depend on the earlier siblings, as drawing without replacement makes it, provided it is the
distribution the sibling was drawn from and the draw is independent of the verifier's uniforms).
By induction over the siblings the token a node emits or moves to is distributed as p after the
node's path; given it moved to child c, the walk under c is the same argument from c, whose subtree
was drafted from c's path alone. So each committed token is distributed as the target given the
tokens before it. With one-hot q (token-only trees: suffix, n-gram) a try accepts with probability
r(x) and the residual is r without x: some child is accepted with the target's whole mass on the
children, which is what extra branches buy. Two mistakes that break it, caught by
tests/engine/core/test_tree_verify.py: trying a sibling against r not updated for the rejected ones,
and trying a token below a rejected one.

Flat glossary: a *node* is a draft token (global index into draft_ids); the root of sequence b is
node N + b in the link tables (N draft tokens in all). Padded batches (verify_step.py: every tree
given the same number of tokens) pass each sequence's real count as `num_valid`: its pad tokens
(root children past the real ones) are never accepted and never tried (the links park them under a
node no walk reaches).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import MAX_INPUTS
from .verify import SparseProbs, VerifyOutput, _flat_index, _q_at, _q_rows, sample_from_probs

DOUBLINGS = (MAX_INPUTS - 1).bit_length()      # pointer-doubling rounds that cover the deepest tree
BIG = 1 << 62


@dataclass
class TreeIndex:
    """Where every draft token of a batch of trees sits (all [num_draft_tokens] int64, except root_row)."""
    seq: torch.Tensor          # its sequence
    pos: torch.Tensor          # its index among the row's draft tokens
    parent: torch.Tensor       # its parent's global index, -1 for a root child
    judge_row: torch.Tensor    # the target row it is judged against (its parent's, or the root's)
    own_row: torch.Tensor      # the target row after it
    depth: torch.Tensor        # 1 for the root's children
    bits: torch.Tensor         # itself and its ancestors: bit pos + 1 of each
    root_row: torch.Tensor     # [num_seqs] each sequence's root row


def tree_index(cu_num_draft: torch.Tensor, parents: torch.Tensor) -> TreeIndex:
    """Depths and ancestor bits by pointer doubling (no host loop over tokens)."""
    num_seqs = len(cu_num_draft) - 1
    seq, pos, _ = _flat_index(cu_num_draft, parents.shape[0])
    root_row = cu_num_draft[:-1] + torch.arange(num_seqs, device=parents.device)
    parent = torch.where(parents >= 0, cu_num_draft[seq] + parents, -1)
    depth, bits, ptr = torch.ones_like(pos), torch.ones_like(pos) << (pos + 1), parent
    for _ in range(DOUBLINGS):
        has = ptr >= 0
        safe = ptr.clamp(min=0)
        depth = depth + torch.where(has, depth[safe], 0)
        bits = bits | torch.where(has, bits[safe], 0)
        ptr = torch.where(has, ptr[safe], -1)
    return TreeIndex(seq, pos, parent, root_row[seq] + 1 + parents, root_row[seq] + 1 + pos, depth, bits, root_row)


def _tree_links(idx: TreeIndex, num_seqs: int,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first child of each node and root [N + num_seqs (+ 1 parking node where `valid`)], next sibling of
    each node [N]); -1: none. Tokens not `valid` hang under the parking node N + num_seqs."""
    n = len(idx.pos)
    device = idx.pos.device
    holder = torch.where(idx.parent >= 0, idx.parent, n + idx.seq)          # [N] parent as a node or a root
    if valid is not None:
        holder = torch.where(valid, holder, n + num_seqs)
    first = torch.full((n + num_seqs + (valid is not None),), BIG, dtype=torch.long, device=device)
    first.scatter_reduce_(0, holder, torch.arange(n, device=device), reduce="amin", include_self=True)
    first = torch.where(first == BIG, -1, first)
    order = torch.argsort(holder * (n + 1) + torch.arange(n, device=device))
    nxt = torch.full((n,), -1, dtype=torch.long, device=device)
    if n > 1:
        same = holder[order[1:]] == holder[order[:-1]]
        nxt[order[:-1]] = torch.where(same, order[1:], -1)
    return first, nxt


def _greedy_choice(draft_ids: torch.Tensor, idx: TreeIndex, target_argmax: torch.Tensor,
                   num_seqs: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[num_seqs] the deepest token whose path matches the argmax at every step (row-local, -1: none)."""
    ok = draft_ids == target_argmax[idx.judge_row]
    if valid is not None:
        ok &= valid
    bad = torch.zeros(num_seqs, dtype=torch.long, device=draft_ids.device).index_add_(
        0, idx.seq, torch.where(ok, 0, torch.ones_like(idx.pos) << (idx.pos + 1)))   # distinct bits: sum = or
    good = (idx.bits & bad[idx.seq]) == 0
    score = torch.where(good, idx.depth * MAX_INPUTS + (MAX_INPUTS - 1 - idx.pos), -1)
    best = torch.full((num_seqs,), -1, dtype=torch.long, device=draft_ids.device).scatter_reduce_(
        0, idx.seq, score, reduce="amax", include_self=True)
    return torch.where(best >= 0, MAX_INPUTS - 1 - best % MAX_INPUTS, -1)


def _residual(rows: torch.Tensor, total: torch.Tensor, q_rows: torch.Tensor) -> torch.Tensor:
    """norm([r - q]+) (unnormalised) for rejected tries; r itself where p == q left nothing (a rejection
    of probability 0)."""
    res = (rows / total.unsqueeze(1) - q_rows).clamp_(min=0)
    return torch.where((res.sum(dim=-1) <= 0).unsqueeze(1), rows, res)


def _sampled_walk(draft_ids, cu_num_draft, idx: TreeIndex, target_probs, draft_probs, walking, accept_uniforms,
                  tries: int | None = None, valid: torch.Tensor | None = None):
    """The sampling rule for the sequences in `walking` [num_seqs] bool. Returns (node each walk ended
    at, global, num_draft_tokens + b where it stayed at the root; r at the end [num_seqs, vocab]).

    A try judges one candidate node: accepted, the walk moves to its first child; rejected, r becomes the
    residual and the walk moves to its next sibling; so a walk makes at most as many tries as its tree
    has nodes. With `tries` (at least the largest tree's size) every row takes part in that many tries,
    a finished walk changing nothing, and nothing is read back; without it, each try takes the walks
    still going, and whether one is reads back once per try (cheap where the device is the host)."""
    n, num_seqs, vocab = len(draft_ids), len(cu_num_draft) - 1, target_probs.shape[-1]
    device = draft_ids.device
    first, nxt = _tree_links(idx, num_seqs, valid)
    q_y = torch.ones(n, dtype=target_probs.dtype, device=device) if draft_probs is None else \
        _q_at(draft_probs, draft_ids).to(target_probs.dtype)
    cur = n + torch.arange(num_seqs, device=device)
    cand = first[cur]
    r = target_probs[idx.root_row].clone()                                  # [num_seqs, vocab]
    active = (cand >= 0) & walking
    if tries is not None:
        for _ in range(tries if n else 0):
            c = cand.clamp(min=0)
            total = r.sum(dim=-1)
            hit = accept_uniforms[c].to(r.dtype) * q_y[c] * total < r.gather(1, draft_ids[c].unsqueeze(1)).squeeze(1)
            accept, reject = active & hit, active & ~hit
            cur = torch.where(accept, c, cur)
            residual = _residual(r, total, _q_rows(draft_probs, draft_ids, c, vocab, r.dtype))
            r = torch.where(accept.unsqueeze(1), target_probs[idx.own_row[c]],
                            torch.where(reject.unsqueeze(1), residual, r))
            cand = torch.where(accept, first[c], torch.where(reject, nxt[c], cand))
            active = (cand >= 0) & walking
        return cur, r
    while bool(active.any()):
        a = active.nonzero().squeeze(1)
        c = cand[a]
        rows = r[a]
        total = rows.sum(dim=-1)
        accept = accept_uniforms[c].to(rows.dtype) * q_y[c] * total < rows.gather(1, draft_ids[c].unsqueeze(1)).squeeze(1)
        acc_a, acc_c, rej_a, rej_c = a[accept], c[accept], a[~accept], c[~accept]
        cur[acc_a] = acc_c
        r[acc_a] = target_probs[idx.own_row[acc_c]]
        cand[acc_a] = first[acc_c]
        if len(rej_a):
            r[rej_a] = _residual(rows[~accept], total[~accept],
                                 _q_rows(draft_probs, draft_ids, rej_c, vocab, rows.dtype))
            cand[rej_a] = nxt[rej_c]
        active = (cand >= 0) & walking
    return cur, r


def verify_tree(
    draft_ids: torch.Tensor,          # [num_draft_tokens] int64, flat
    cu_num_draft: torch.Tensor,       # [num_seqs + 1] int64 offsets
    parents: torch.Tensor,            # [num_draft_tokens] int64 row-local parent, -1: the root
    target_probs: torch.Tensor,       # [num_draft_tokens + num_seqs, vocab] processed p (module docstring)
    draft_probs: "torch.Tensor | SparseProbs | None",  # q per token: the distribution it was drawn from
    is_greedy: torch.Tensor,          # [num_seqs] bool
    accept_uniforms: torch.Tensor,    # [num_draft_tokens] in [0, 1)
    sample_uniforms: torch.Tensor,    # [num_seqs] in [0, 1)
    max_depth: int | None = None,     # the deepest tree's depth, where the host knows it
    greedy: tuple[bool, bool] | None = None,   # (any, all) of is_greedy, where the host knows them
    tries: int | None = None,         # the sampled walk's tries, at least the largest tree's size (_sampled_walk)
    num_valid: torch.Tensor | None = None,   # [num_seqs] padded batches: each tree's real token count
) -> VerifyOutput:
    """The greedy or sampling rule for every tree of a ragged batch; `path` holds the accepted tokens.
    With max_depth, greedy and tries given, nothing is read back from the device; without tries the
    sampled walk reads back once per try whether a walk is still going."""
    num_seqs, n = len(cu_num_draft) - 1, len(draft_ids)
    any_greedy, all_greedy = greedy if greedy is not None else (bool(is_greedy.any()), bool(is_greedy.all()))
    idx = tree_index(cu_num_draft, parents)
    valid = None if num_valid is None else idx.pos < num_valid[idx.seq]
    chosen = torch.full((num_seqs,), -1, dtype=torch.long, device=draft_ids.device)
    if n and any_greedy:
        chosen = _greedy_choice(draft_ids, idx, target_probs.argmax(dim=-1), num_seqs, valid)
    final_row = idx.root_row + 1 + chosen
    final_tok = target_probs[final_row].argmax(dim=-1) if any_greedy else None
    if not all_greedy:
        cur, r = _sampled_walk(draft_ids, cu_num_draft, idx, target_probs, draft_probs, ~is_greedy, accept_uniforms,
                               tries, valid)
        walked = torch.where(cur < n, idx.pos[cur.clamp(max=max(n - 1, 0))] if n else cur, -1)
        chosen = torch.where(is_greedy, chosen, walked)
        sampled = sample_from_probs(r, sample_uniforms)
        final_tok = sampled if final_tok is None else torch.where(is_greedy, final_tok, sampled)
    return _assemble_tree(draft_ids, cu_num_draft, idx, chosen, final_tok, max_depth)


def verify_tree_greedy(draft_ids: torch.Tensor, cu_num_draft: torch.Tensor, parents: torch.Tensor,
                       target_argmax: torch.Tensor, max_depth: int | None = None,
                       num_valid: torch.Tensor | None = None) -> VerifyOutput:
    """The greedy rule alone, from the target's argmax per row ([num_draft_tokens + num_seqs])."""
    num_seqs = len(cu_num_draft) - 1
    idx = tree_index(cu_num_draft, parents)
    valid = None if num_valid is None else idx.pos < num_valid[idx.seq]
    chosen = (_greedy_choice(draft_ids, idx, target_argmax, num_seqs, valid) if len(draft_ids)
              else torch.full((num_seqs,), -1, dtype=torch.long, device=draft_ids.device))
    return _assemble_tree(draft_ids, cu_num_draft, idx, chosen, target_argmax[idx.root_row + 1 + chosen], max_depth)


def _assemble_tree(draft_ids, cu_num_draft, idx: TreeIndex, chosen, final_tok, max_depth: int | None) -> VerifyOutput:
    """Per sequence: the accepted path's tokens then the final token (-1 padded), the path's indices. The
    accepted tokens land by a scatter whose rejected tokens go to a spare column (no value-dependent shape);
    max_depth is read from the device only where the caller does not know it."""
    num_seqs, device = len(cu_num_draft) - 1, draft_ids.device
    has = chosen >= 0
    node = (cu_num_draft[:-1] + chosen).clamp(min=0)
    n = len(draft_ids)
    chosen_bits = torch.where(has, idx.bits[node.clamp(max=n - 1)], 0) if n else torch.zeros_like(chosen)
    num_accepted = torch.where(has, idx.depth[node.clamp(max=n - 1)], 0) if n else torch.zeros_like(chosen)
    is_accepted = ((chosen_bits[idx.seq] >> (idx.pos + 1)) & 1).bool()
    if max_depth is None:
        max_depth = int(idx.depth.max()) if n else 0
    spare = max_depth + 1                                  # column of the tokens off the accepted path
    col = torch.where(is_accepted, idx.depth - 1, spare)
    output_ids = torch.full((num_seqs, spare + 1), -1, dtype=torch.long, device=device)
    path = torch.full((num_seqs, spare + 1), -1, dtype=torch.long, device=device)
    output_ids.index_put_((idx.seq, col), draft_ids)
    path.index_put_((idx.seq, col), idx.pos)
    output_ids, path = output_ids[:, :max_depth + 1], path[:, :max_depth]
    final_col = torch.arange(max_depth + 1, device=device).unsqueeze(0) == num_accepted.unsqueeze(1)
    output_ids = torch.where(final_col, final_tok.unsqueeze(1), output_ids)
    return VerifyOutput(num_accepted=num_accepted, output_ids=output_ids, is_accepted=is_accepted, path=path)
