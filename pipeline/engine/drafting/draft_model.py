"""DraftModelDrafter: a small model sharing the target's tokenizer, over its own slot KV store.

Its per-sequence KV follows the committed history (rollback = a length); it owns those lengths and
their catch-up (adaptive mode prefills a sequence only when it is about to draft). `sample_method`
"greedy" proposes the draft's argmax (token only, one-hot q); "probabilistic" samples from q, processed
as the target's p is, with the sequence's draft generator, and keeps q for verification.

It knows nothing about verification, stops or cost models.
"""
from __future__ import annotations

import torch

from ..core.prefix import Reuse
from ..core.request import Sequence
from ..core.sampling import RowParams, greedy_tokens, penalty_counts, processed_probs, row_probs
from ..core.verify import sample_from_probs
from ..grammar.walk import GuideView
from ..model.prefill import Chunk, forward_history
from ..model.runner import ModelRunner
from .base import DraftBatch


def draft_lag(num_tokens: int, num_computed: int) -> int:
    """Draft-model positions to prefill before a sequence of `num_tokens` committed tokens, with
    `num_computed` draft KV positions, can draft: its history (all but the last token, the next
    round's input) beyond the draft KV, or 0 when that lag is the 1-2 positions a drafting round
    leaves behind anyway."""
    lag = num_tokens - 1 - num_computed
    return lag if lag > 2 else 0



def _uniforms(generators: list[torch.Generator], device) -> torch.Tensor:
    """[rows] one uniform per row, each from its sequence's own draft generator."""
    return torch.tensor([float(torch.rand(1, generator=g)) for g in generators], device=device)



class DraftModelDrafter:
    """A draft model over its own slot KV store (the sequence's slot). Owns each running sequence's
    draft KV length: it follows the committed history, lags it after a round by at most 2 (a bonus
    token), and is rolled back on commit (a length move).

    Prefix reuse: where the target copies a prompt prefix from a donor slot, the draft copies the
    part of it its own store holds for the donor's prompt (its holder's draft KV, or what the last
    holder left when it finished), so a shared system prompt is computed once by the draft too."""
    kind = "draft"
    is_free = False

    def __init__(self, runner: ModelRunner, sample_method: str = "greedy"):
        if sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"draft_sample_method: expected 'greedy' or 'probabilistic', got {sample_method!r}")
        self.runner, self.sample_method = runner, sample_method
        self._computed: dict[Sequence, int] = {}      # draft positions with KV, per sequence holding a slot
        self._left: dict[int, int] = {}               # slot -> prompt positions of draft KV its last holder left

    @property
    def draft_runner(self) -> ModelRunner:
        return self.runner

    def num_computed(self, seq: Sequence) -> int:
        """Draft-model positions of `seq` with KV."""
        return self._computed.get(seq, 0)

    def prefill(self, chunks: list[Chunk]) -> None:
        forward_history(self.runner, chunks, self.num_computed)
        for seq, n in chunks:
            self._computed[seq] = self.num_computed(seq) + n

    def catch_up_lag(self, seq: Sequence) -> int:
        return draft_lag(seq.num_tokens, self.num_computed(seq))

    def catch_up(self, seqs: list[Sequence], lengths: list[int], budget: int) -> tuple[list[int], int]:
        """Bring the draft KV up to the committed history for sequences about to draft whose draft KV
        lags by more than a round's usual 1-2 tokens (a new prompt, or a stretch at g = 0), within
        `budget` positions; a sequence still behind drafts nothing this round."""
        lengths, chunks = list(lengths), []
        for b, (seq, g) in enumerate(zip(seqs, lengths)):
            lag = self.catch_up_lag(seq)
            if g == 0 or not lag:
                continue
            take = min(lag, budget)
            if take:
                chunks.append((seq, take))
                budget -= take
            if take < lag:
                lengths[b] = 0
        self.prefill(chunks)
        self.runner.synchronize()
        return lengths, sum(n for _, n in chunks)

    def on_commit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:                   # rollback = a length: KV for committed tokens only
            if seq in self._computed:
                self._computed[seq] = min(self._computed[seq], seq.num_tokens - 1)

    def release(self, seq: Sequence) -> None:
        self._left[seq.slot] = self._prompt_held(seq)
        self._computed.pop(seq, None)

    def _prompt_held(self, seq: Sequence) -> int:
        return min(self.num_computed(seq), len(seq.prompt_ids))

    def reuse_prefix(self, seq: Sequence, reuse: Reuse) -> None:
        """Copy draft KV [0, m) from the donor slot, m = the target's count capped by the prompt
        positions the draft store holds there for the same prompt: the live holder's, or what the
        slot's last holder left (the target's index matches a slot against its current holder, or
        against a finished one's frozen prompt)."""
        m = 0
        if reuse.num_tokens:
            held = (self._prompt_held(reuse.holder) if reuse.holder is not None
                    else self._left.get(reuse.slot, 0))
            m = min(reuse.num_tokens, held)
            if m and reuse.slot != seq.slot:
                self.runner.copy_prefix(reuse.slot, seq.slot, m)
        self._left.pop(seq.slot, None)
        if m:
            self._computed[seq] = m

    def propose(self, seqs: list[Sequence], lengths: list[int],
                generators: list[torch.Generator], guide: GuideView | None = None) -> DraftBatch:
        """With a guide, seqs[b]'s draft starts after its forced tokens guide.ahead(b) (fed to the
        draft model like drafted ones) and each step's q is masked by the grammar at that position:
        q is then the draft's distribution restricted to what the grammar allows, as p will be. The
        grammar advances on the host, so a guided proposal reads each step's tokens back; without one
        the tokens stay on the device from step to step and the proposal reads them back once."""
        # Token only (one-hot q, never stored) for the greedy method or an all-greedy batch.
        token_only = self.sample_method == "greedy" or all(s.params.is_greedy for s in seqs)
        if guide is None:
            return self._propose_on_device(seqs, lengths, generators, token_only)
        ahead = [list(guide.ahead(b)) if guide else [] for b in range(len(seqs))]
        proposals: list[list[int]] = [list(a) for a in ahead]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(lengths, default=0)):
            active = [b for b, g in enumerate(lengths) if g > step]
            allowed = guide.allowed(active, self.runner.device) if guide else None
            tokens = self._draft_step([seqs[b] for b in active], [proposals[b] for b in active],
                                      [probs[b] for b in active], [generators[b] for b in active], token_only,
                                      allowed)
            for b, tok in zip(active, tokens):
                if guide:
                    guide.advance(b, tok)
        own = [p[len(a):] for p, a in zip(proposals, ahead)]
        flat_probs = None if token_only or not any(probs) else torch.cat([torch.stack(p) for p in probs if p])
        return DraftBatch.from_lists(own, self.runner.device, flat_probs)

    def _propose_on_device(self, seqs: list[Sequence], lengths: list[int], generators: list[torch.Generator],
                           token_only: bool) -> DraftBatch:
        """The proposal without a grammar: step 1 feeds each row's committed tokens the draft has no KV for,
        each later step the row's previous draft token straight from the device (ModelRunner.forward's
        last_tokens); penalty counts start from the committed history and count each drawn token on the
        device. The same draws as one step at a time with the tokens read back (the same inputs, q and
        uniforms); the tokens of every step are read back once, at the end."""
        device = self.runner.device
        penalties = any(s.params.has_penalties for s in seqs)
        counts = penalty_counts(seqs, [[] for _ in seqs], self.runner.vocab_size, device) if penalties else None
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        drawn: list[tuple[list[int], torch.Tensor]] = []      # per step: its rows (indices into seqs), their tokens
        for step in range(max(lengths, default=0)):
            active = [b for b, g in enumerate(lengths) if g > step]
            rows = [seqs[b] for b in active]
            starts = [self.num_computed(seq) for seq in rows]
            if step == 0:
                inputs, last = [seq.all_ids()[start:] for seq, start in zip(rows, starts)], None
                for seq in rows:
                    self._computed[seq] = seq.num_tokens
            else:
                before, earlier = drawn[-1]
                where = {b: i for i, b in enumerate(before)}
                pick = torch.tensor([where[b] for b in active], dtype=torch.long, device=device)
                last = earlier.index_select(0, pick)
                inputs = [[0]] * len(rows)                     # placeholders for `last`
                for seq in rows:
                    self._computed[seq] += 1
            logits = self.runner.forward([seq.slot for seq in rows], starts, inputs, logits="last", last_tokens=last)
            rp = RowParams.from_params([seq.params for seq in rows], device)
            index = torch.tensor(active, dtype=torch.long, device=device) if penalties else None
            row_counts = tuple(c.index_select(0, index) for c in counts) if penalties else (None, None)
            if token_only:
                tokens = greedy_tokens(logits, rp, *row_counts)
            else:
                q = processed_probs(logits, rp, *row_counts)
                tokens = sample_from_probs(q, _uniforms([generators[b] for b in active], device))
                for i, b in enumerate(active):
                    probs[b].append(q[i])
            if penalties:
                counts[0].index_put_((index, tokens), torch.ones(len(active), device=device), accumulate=True)
            drawn.append((active, tokens))
        flat = torch.cat([tokens for _, tokens in drawn]).tolist() if drawn else []   # the proposal's one read
        proposals: list[list[int]] = [[] for _ in seqs]
        at = 0
        for active, _ in drawn:
            for b in active:
                proposals[b].append(flat[at])
                at += 1
        flat_probs = None if token_only or not any(probs) else torch.cat([torch.stack(p) for p in probs if p])
        return DraftBatch.from_lists(proposals, device, flat_probs)

    def _draft_step(self, seqs: list[Sequence], proposals: list[list[int]], probs: list[list],
                    generators: list[torch.Generator], token_only: bool,
                    allowed: torch.Tensor | None = None) -> list[int]:
        """One draft forward for these sequences: catch up on committed tokens the draft has no KV for
        (first step of a round) or feed the previous proposed token; propose the next one under the
        grammar masks `allowed` ([rows, vocab] bool, or None). Returns the new tokens."""
        starts, inputs = [self.num_computed(seq) for seq in seqs], []
        for seq, prop, start in zip(seqs, proposals, starts):
            history = seq.all_ids() + prop[:-1]            # tokens the draft must have KV for
            inputs.append(history[start:] + prop[-1:])
            self._computed[seq] = len(history) + (1 if prop else 0)
        logits = self.runner.forward([seq.slot for seq in seqs], starts, inputs, logits="last")   # [rows, vocab]
        if token_only:
            tokens = row_probs(logits, seqs, proposals, argmax_only=True, allowed=allowed)
        else:
            q = row_probs(logits, seqs, proposals, allowed=allowed)          # [rows, vocab]
            tokens = sample_from_probs(q, _uniforms(generators, q.device))
            for b in range(len(seqs)):
                probs[b].append(q[b])
        tokens = tokens.tolist()
        for b, tok in enumerate(tokens):
            proposals[b].append(tok)
        return tokens
