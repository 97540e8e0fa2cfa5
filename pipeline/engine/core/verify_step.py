"""A verify step at fixed shapes: the target's logits processed and the verifier's rule applied to rows
padded to a common length, so that both run on the device right after the step's forward (inside its
CUDA graph: backends/cuda/graphs.py) and the step reads back one buffer.

  padded step  R rows of Q inputs each (the graph bucket's rows and tokens per row). Row b's inputs are
               its last committed token and its g_b <= Q - 1 draft tokens (a path, or a token tree),
               then pad tokens; a pad row (past the step's real rows) drafts nothing. Its logits are all
               R * Q positions in that order: verify.py's (verify_tree.py's) flat layout with every row
               given Q - 1 draft tokens, g_b of them real; a tree's pad tokens are root children.
  spec         what fixes the tail's kernels besides the bucket (TailSpec): whether all, some or none of
               the rows are greedy, the top-k width, top-p, min-p, grammar masks, a dense q, trees. Steps
               with the same bucket and spec run the same kernels (on a GPU: replay the same graph).
  inputs       a step's host data as one byte string (Tail.host_bytes): draft ids, counts, tree
               parents, rows' slots and each position's draft tokens before it (penalties) (int64),
               the rows' sampling columns and the uniforms (float32), grammar bit masks (int32); it
               travels in the step's one host-to-device copy. A dense q (a draft model's, already on
               the device; a sparse one made dense there first) is copied device to device (Tail.load_q).
  output       one int64 buffer [R + R*Q + R*(Q-1) (+ R*(Q-1) for trees)]: accepted counts, output
               ids ([R, Q], -1 padded), the per-position acceptance ([R, Q-1]), a tree's accepted path
               ([R, Q-1]); `unpack` turns the real rows of its host copy into the rule's HostVerifyOutput.

The result is the eager rule's (verify_rule.py over the real rows), token for token: each row is
processed alone (sampling.py, with the step's batch facts taken from its real rows), the uniforms are
the same, and verify.py is told each row's real draft count (`num_valid`), past which nothing is
accepted and the final token is drawn as where the draft ends (a tree's pad tokens are never tried:
verify_tree.py). A sampled tree walk makes Q - 1 tries, as on a GPU (verify_rule.py's FIXED_WALK).

Penalties count each row's prompt and committed output in tables kept per slot on the device
(SlotCounts: brought up to date before the step from what the rows committed since, the updates
riding in the step's one copy) plus, per position, the draft tokens of its path (a fixed [R*Q, Q-1]
index): the counts the eager rule builds from each row's history.

A sparse q (suffix counts: SparseProbs) is made dense on the device before the step (its support
size varies: no fixed shape), and the tail takes it as a dense q: the same q(y) and residual rows.

This module knows nothing about models, graphs or requests beyond their sampling parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import SamplingParams
from .sampling import RowParams, greedy_tokens, processed_probs, top_k_width
from .tree import chain, path_tokens
from .verify import HostVerifyOutput, SparseProbs, verify, verify_greedy
from .verify_tree import verify_tree, verify_tree_greedy

_PAD_COLUMNS = dict(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                    presence_penalty=0.0, frequency_penalty=0.0)     # pad rows: any valid values do


@dataclass(frozen=True)
class TailSpec:
    greedy: str        # "all" | "some" | "none": rows under the greedy rule
    top_k: int         # the top-k width (a power of two, at most the vocabulary); 0: no row keeps only its top k
    top_p: bool
    min_p: bool
    grammar: bool      # grammar bit masks per target row
    dense_q: bool      # a q ([num_draft_tokens, vocab] on the device, or sparse); False: one-hot drafts
    tree: bool = False  # token trees (each row's parents among the inputs)
    penalties: bool = False   # repetition / presence / frequency penalties on some row


@dataclass
class VerifyStep:
    """A verify step's host data."""
    proposals: list[list[int]]                              # each row's draft tokens
    params: list[SamplingParams]                            # each row's sampling parameters
    uniforms: tuple[torch.Tensor, torch.Tensor] | None      # host (accept [sum g], sample [rows]) where any
                                                            # row samples (the engine's draws)
    allowed: torch.Tensor | None                            # host [sum(g + 1), words] int32 grammar masks
    draft_probs: torch.Tensor | SparseProbs | None          # q: dense on the device, sparse, None (one-hot)
    parents: list[list[int]] | None = None                  # token trees: each row's tokens' parents (core/tree.py)
    histories: list[tuple[list[int], list[int]]] | None = None   # penalties: each row's (prompt, output) ids
    slots: list[int] | None = None                          # penalties: each row's slot

    @property
    def num_draft(self) -> list[int]:
        return [len(p) for p in self.proposals]


def tail_spec(step: VerifyStep, vocab: int) -> TailSpec:
    """The spec of a step's tail. The batch facts are the ones RowParams.from_params takes from the
    same rows."""
    params = step.params
    greedy = [p.is_greedy for p in params]
    kind = "all" if all(greedy) else "some" if any(greedy) else "none"
    filters = kind != "all" and any(p.has_filters and not p.is_greedy for p in params)
    width = top_k_width([p.top_k for p in params], vocab) if filters else 0
    if width:                   # rounded up: fewer kinds of step, the same kept tokens
        width = min(1 << (width - 1).bit_length(), vocab)
    return TailSpec(kind, width, filters and any(p.top_p < 1 for p in params),
                    filters and any(p.min_p > 0 for p in params), step.allowed is not None,
                    kind != "all" and step.draft_probs is not None, step.parents is not None,
                    any(p.has_penalties for p in params))


def _padded(n: int) -> int:
    return -(-n // 8) * 8


class SlotCounts:
    """Each slot's prompt and committed output as token counts on the device ([slots, vocab + 1] float32
    each; column `vocab` takes padding), for penalties at fixed shapes. The host remembers how much of
    each slot's output the table holds; `forget` when the slot's sequence leaves."""

    def __init__(self, num_slots: int, vocab: int, device):
        self.vocab = vocab
        self.prompt = torch.zeros(num_slots, vocab + 1, dtype=torch.float32, device=device)
        self.output = torch.zeros(num_slots, vocab + 1, dtype=torch.float32, device=device)
        self.synced: dict[int, int] = {}       # slot -> output tokens counted

    def forget(self, slot: int) -> None:
        self.synced.pop(slot, None)

    def updates(self, slots: list[int], histories: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        """What brings the tables up to date for these rows: [slots to clear, prompt count indices,
        output count indices] (flat indices slot * (vocab + 1) + token); the host's record moves on."""
        width = self.vocab + 1
        clear, prompt, output = [], [], []
        for slot, (prompt_ids, output_ids) in zip(slots, histories):
            done = self.synced.get(slot)
            if done is None or done > len(output_ids):      # a new sequence in this slot
                clear.append(slot)
                prompt += [slot * width + t for t in prompt_ids]
                done = 0
            output += [slot * width + t for t in output_ids[done:]]
            self.synced[slot] = len(output_ids)
        return [clear, prompt, output]

    def apply(self, staged: torch.Tensor, sizes: list[int]) -> None:
        """The updates (`updates`' lists, staged as one int64 tensor on the device) into the tables."""
        clear, prompt, output = staged.split(sizes)
        for table, index in ((self.prompt, prompt), (self.output, output)):
            table.index_fill_(0, clear, 0.0)
            table.view(-1).index_add_(0, index, torch.ones(len(index), dtype=table.dtype, device=table.device))


class Tail:
    """One (rows, Q, spec)'s static inputs and output on the device, and the tail itself (`run`)."""

    def __init__(self, rows: int, q: int, vocab: int, words: int, spec: TailSpec, device,
                 q_buffer: torch.Tensor | None = None, counts: SlotCounts | None = None):
        self.rows, self.q, self.vocab, self.words, self.spec = rows, q, vocab, words, spec
        g = q - 1
        self.counts = counts if spec.penalties else None
        penalty_ints = (rows + rows * q * g) if spec.penalties else 0     # slots, path tokens before each position
        self.sizes = (rows * g * (1 + spec.tree) + rows + penalty_ints,
                      len(RowParams.COLUMNS) * rows * q + rows * g + rows,
                      rows * q * words if spec.grammar else 0)          # int64, float32, int32 elements
        self.offsets = [0, _padded(8 * self.sizes[0])]
        self.offsets.append(self.offsets[1] + _padded(4 * self.sizes[1]))
        self.nbytes = self.offsets[2] + _padded(4 * self.sizes[2])
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        ints, floats, bits = (self.buffer[o:o + n * w].view(t) for o, n, w, t in zip(
            self.offsets, self.sizes, (8, 4, 4), (torch.int64, torch.float32, torch.int32)))
        self.draft_ids, self.num_draft, self.parents, self.slots, self.before = ints.split(
            [rows * g, rows, rows * g * spec.tree, rows if spec.penalties else 0, penalty_ints and rows * q * g])
        cols, self.accept_u, self.sample_u = floats.split([len(RowParams.COLUMNS) * rows * q, rows * g, rows])
        self.cols = cols.view(len(RowParams.COLUMNS), rows * q)
        self.bits = bits.view(rows * q, words) if spec.grammar else None
        self.cu = torch.arange(rows + 1, device=device) * g
        self.draft_q = q_buffer[:rows * g] if spec.dense_q else None
        self.out = torch.zeros(rows + rows * q + rows * g * (1 + spec.tree), dtype=torch.long, device=device)
        self.replay = None          # a graph's replay, once captured and checked (backends/cuda/graphs.py)
        self._updates: list[int] = [0, 0, 0]    # the staged count updates' sizes (host_bytes -> load)

    def host_bytes(self, step: VerifyStep) -> torch.Tensor:
        """The step's inputs as the buffer's bytes (uint8, on the host)."""
        rows, q, g = self.rows, self.q, self.q - 1
        num = step.num_draft
        ids = [t for p in step.proposals for t in p + [0] * (g - len(p))] + [0] * ((rows - len(num)) * g)
        parents = []
        if self.spec.tree:          # pad tokens: root children, never tried (verify_tree.py's num_valid)
            parents = [p for row in step.parents for p in row + [-1] * (g - len(row))] + [-1] * ((rows - len(num)) * g)
        slots, before = [], []
        if self.spec.penalties:     # each position's path tokens (its own draft token included)
            slots = step.slots + [0] * (rows - len(num))
            for b in range(rows):
                row = step.proposals[b] if b < len(num) else []
                paths = path_tokens(step.parents[b] if self.spec.tree and b < len(num) else chain(len(row)), row)
                paths += [[]] * (q - len(paths))
                before += [t for path in paths for t in path + [self.vocab] * (g - len(path))]
        ints = torch.tensor(ids + num + [0] * (rows - len(num)) + parents + slots + before, dtype=torch.int64)
        pad = [_PAD_COLUMNS[c] for c in RowParams.COLUMNS]
        cols = [[getattr(p, c) for c in RowParams.COLUMNS] for p in step.params for _ in range(q)]
        cols = torch.tensor(cols + [pad] * ((rows - len(num)) * q), dtype=torch.float32).T.reshape(-1)
        accept, sample = torch.zeros(rows, g), torch.zeros(rows)
        if step.uniforms is not None:
            cu = [0]
            for n in num:
                cu.append(cu[-1] + n)
            for b, n in enumerate(num):
                accept[b, :n] = step.uniforms[0][cu[b]:cu[b] + n]
            sample[:len(num)] = step.uniforms[1]
        parts = [ints, torch.cat([cols, accept.reshape(-1), sample])]
        if self.spec.grammar:
            bits = torch.full((rows, q, self.words), -1, dtype=torch.int32)
            r = 0
            for b, n in enumerate(num):
                bits[b, :n + 1] = step.allowed[r:r + n + 1]
                r += n + 1
            parts.append(bits.reshape(-1))
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        for o, part in zip(self.offsets, parts):
            raw = part.view(torch.uint8)
            out[o:o + raw.numel()] = raw
        if self.counts is None:
            return out
        updates = self.counts.updates(step.slots, step.histories)      # after the fixed bytes: see load
        self._updates = [len(u) for u in updates]
        flat = torch.tensor([i for u in updates for i in u], dtype=torch.int64)
        return torch.cat([out, flat.view(torch.uint8)])

    def load(self, staged: torch.Tensor) -> None:
        """The staged bytes (host_bytes', on the device) into the buffer; count updates into the tables."""
        self.buffer.copy_(staged[:self.nbytes])
        if self.counts is not None:
            self.counts.apply(staged[self.nbytes:].view(torch.int64), self._updates)

    def load_q(self, step: VerifyStep) -> None:
        """A dense q into its padded rows (device to device; rows past a row's drafts keep stale values,
        which the rule never reads)."""
        if self.draft_q is None:
            return
        g = self.q - 1
        index = [b * g + i for b, n in enumerate(step.num_draft) for i in range(n)]
        if index:
            q = step.draft_probs
            if isinstance(q, SparseProbs):        # no shape depends on its values (SparseProbs.dense)
                q = q.dense(torch.arange(len(index), device=q.row.device), len(index), self.vocab, torch.float32)
            self.draft_q.index_copy_(0, torch.tensor(index, device=self.draft_q.device), q.to(self.draft_q.dtype))

    def run(self, logits: torch.Tensor) -> None:
        """The tail over the step's logits [R*Q, vocab]; the result into `out`. Reads nothing back."""
        spec, rows, g = self.spec, self.rows, self.q - 1
        rp = RowParams.from_columns(self.cols, any_greedy=spec.greedy != "none", top_k_width=spec.top_k,
                                    any_top_p=spec.top_p, any_min_p=spec.min_p, penalties=spec.penalties)
        counts = self._penalty_counts() if spec.penalties else (None, None)
        if spec.greedy == "all":
            argmax = greedy_tokens(logits, rp, *counts, allowed=self.bits)
            out = (verify_tree_greedy(self.draft_ids, self.cu, self.parents, argmax, max_depth=g,
                                      num_valid=self.num_draft) if spec.tree
                   else verify_greedy(self.draft_ids, self.cu, argmax, max_draft=g, num_valid=self.num_draft))
        else:
            probs = processed_probs(logits, rp, *counts, allowed=self.bits)
            is_greedy = rp.is_greedy.view(rows, self.q)[:, 0]
            if spec.tree:
                out = verify_tree(self.draft_ids, self.cu, self.parents, probs, self.draft_q, is_greedy, self.accept_u,
                                  self.sample_u, max_depth=g, greedy=(spec.greedy == "some", False), tries=g,
                                  num_valid=self.num_draft)
            else:
                out = verify(self.draft_ids, self.cu, probs, self.draft_q, is_greedy, self.accept_u, self.sample_u,
                             max_draft=g, any_greedy=spec.greedy == "some", num_valid=self.num_draft)
        parts = [out.num_accepted, out.output_ids.reshape(-1), out.is_accepted.long()]
        torch.cat(parts + [out.path.reshape(-1)] if spec.tree else parts, out=self.out)

    def _penalty_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Output and prompt counts per position [R*Q, vocab]: its slot's, plus its path's draft tokens."""
        rows, q, g, vocab = self.rows, self.q, self.q - 1, self.vocab
        slot = self.slots.unsqueeze(1).expand(rows, q).reshape(-1)
        output = self.counts.output[slot]
        if g:
            before = self.before.view(rows * q, g)
            output = output.scatter_add(1, before, torch.ones(before.shape, dtype=output.dtype, device=output.device))
        return output[:, :vocab], self.counts.prompt[slot][:, :vocab]


class Readback:
    """A tail's output on its way to the host: the copy is started, not waited for (on CUDA into pinned
    memory, with an event), so the host may launch the next step before it reads this one. `first_tokens`
    keeps each row's first output token on the device ([rows]: all that a step without drafts emits,
    and so the next step's input), taken before a later step overwrites the tail's output."""

    def __init__(self, out: torch.Tensor, rows: int, q: int, num_draft: list[int], tree: bool):
        self.rows, self.q, self.num_draft, self.tree = rows, q, num_draft, tree
        self.first_tokens = out[rows:rows + rows * q:q].clone()
        if out.device.type == "cuda":
            self._host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            self._host.copy_(out, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = out.clone(), None
        self._result: HostVerifyOutput | None = None

    def result(self) -> HostVerifyOutput:
        """The real rows of the output (waits for the copy: the step's one readback)."""
        if self._result is None:
            if self._done is not None:
                self._done.synchronize()
            self._result = unpack(self._host.tolist(), self.rows, self.q, self.num_draft, self.tree)
        return self._result


def unpack(packed: list[int], rows: int, q: int, num_draft: list[int], tree: bool = False) -> HostVerifyOutput:
    """The real rows of a tail's output (its host copy) as the rule's HostVerifyOutput."""
    g, n = q - 1, len(num_draft)
    base, paths = rows + rows * q, rows + rows * q + rows * g
    return HostVerifyOutput(packed[:n], [packed[rows + b * q:rows + (b + 1) * q] for b in range(n)],
                            [bool(a) for b, k in enumerate(num_draft) for a in packed[base + b * g:base + b * g + k]],
                            [packed[paths + b * g:paths + (b + 1) * g] for b in range(n)] if tree else None)
