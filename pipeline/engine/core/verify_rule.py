"""The verifier's one entry: the rule for a batch's drafts, single paths (verify.py) or token trees
(verify_tree.py), the greedy rule alone or rejection sampling, chosen from what the host knows.

Every size the rule needs (the longest draft, the deepest tree, whether any row is greedy) is taken
from host lists, so verification reads nothing back from the device before the step's one readback
(VerifyOutput.to_host). Sampled token trees are walked a fixed number of tries over every row on the
devices in FIXED_WALK (each read would wait for the device), and only over the walks still going
elsewhere (a CPU reads its own memory): the same result either way (verify_tree._sampled_walk).

This module knows nothing about models, requests or random generators: the caller processes the
target's rows and draws the uniforms.
"""
from __future__ import annotations

import torch

from .tree import depths
from .verify import SparseProbs, VerifyOutput, verify, verify_greedy
from .verify_tree import verify_tree, verify_tree_greedy

FIXED_WALK = {"cuda"}        # device types whose sampled tree walks make a fixed number of tries


def verify_drafts(
    draft_ids: torch.Tensor,               # [num_draft_tokens] int64, flat
    cu_num_draft: torch.Tensor,            # [num_seqs + 1] int64 offsets
    num_draft: list[int],                  # [num_seqs] the same counts on the host
    parents: list[list[int]] | None,       # token trees: per sequence its tokens' parents; None: single paths
    target_rows: torch.Tensor,             # [num_draft_tokens + num_seqs] argmax where all greedy, else
                                           # [num_draft_tokens + num_seqs, vocab] processed p
    draft_probs: "torch.Tensor | SparseProbs | None",   # q: dense, sparse, or None (one-hot)
    greedy: list[bool],                    # [num_seqs] per sequence: the greedy rule
    uniforms: tuple[torch.Tensor, torch.Tensor] | None = None,   # where any samples: (accept
                                           # [num_draft_tokens], sample [num_seqs]) in [0, 1)
) -> VerifyOutput:
    """The rule for every sequence of a ragged batch: argmax rows alone where every sequence is
    greedy (no vocabulary-sized rows), rejection sampling otherwise; over trees where `parents`."""
    tree = (torch.tensor([p for row in parents for p in row], dtype=torch.long, device=target_rows.device)
            if parents is not None else None)
    longest = max((max(depths(row), default=0) for row in parents) if parents is not None else num_draft,
                  default=0)
    if all(greedy):
        if tree is not None:
            return verify_tree_greedy(draft_ids, cu_num_draft, tree, target_rows, max_depth=longest)
        return verify_greedy(draft_ids, cu_num_draft, target_rows, max_draft=longest)
    accept_u, sample_u = uniforms
    is_greedy = torch.tensor(greedy, device=target_rows.device)
    if tree is not None:
        tries = max(num_draft, default=0) if target_rows.device.type in FIXED_WALK else None
        return verify_tree(draft_ids, cu_num_draft, tree, target_rows, draft_probs, is_greedy,
                           accept_u, sample_u, max_depth=longest, greedy=(any(greedy), False), tries=tries)
    return verify(draft_ids, cu_num_draft, target_rows, draft_probs, is_greedy,
                  accept_u, sample_u, max_draft=longest, any_greedy=any(greedy))
