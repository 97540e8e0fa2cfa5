"""SpecEngine: continuous-batched speculative decoding, one round per step().

Glossary (used throughout the engine):
  draft     a token proposed by the drafter (n-gram lookup or a small model)
  accepted  a draft token the verifier kept
  recovered the token emitted at the first rejection, drawn from norm([p - q]+) (greedy: argmax p)
  bonus     the token drawn from p_{g+1} when all g draft tokens were accepted
  committed in the output; nothing past a stop is ever committed
  computed  has KV in a model's slot store; the target always lags the committed tokens by one
  forced    a token a row's grammar (response_format) admits as the only continuation, proposed
            ahead of or after the drafter's own at no draft cost (drafting/guided.py)
  mask      the tokens a row's grammar allows at a position; p and q are masked and renormalised
            (core/sampling.py), so the output is distributed as the target restricted to the grammar
  tree      a draft of several candidate continuations (core/tree.py), verified in one forward
            (core/verify_tree.py); the accepted path's KV is moved next to the committed tokens

The round: admit -> draft -> verify -> commit (rollback = moving lengths) -> emit finished. How much a
row drafts is the draft-length policy's answer (drafting/lengths.py: fixed or adaptive). Where steps
run ahead (engine.run_ahead: captured graphs, on a GPU; ahead.py, a layer a reader of the round can
skip), a round without drafts launches the next one before the host reads it back.

Rows with a response_format also walk their grammar through the round's proposal (grammar/walk.py):
each position's mask is computed once, used by the drafter and the verifier, and the walk is
settled back to the committed tokens at commit (undoing only the rejected ones).

Requests are checked, admitted and prefilled in admit.py; the records handed out are built in
records.py; the cost curves are measured and fed each step's seconds in calibration.py.

This module knows nothing about files, Ray, or tokenisation beyond an optional `decode` callable
used for stop strings and output text. It reaches the drafter only through the Drafter protocol
(drafting/: the draft model's KV lengths and catch-up are the drafter's), and measures costs
through drafting/cost.py.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch

from .admit import Intake, admit_and_prefill
from .ahead import RunAhead
from .calibration import measured_curves, observe_step
from .config import AUTO, DraftingConfig, EngineConfig
from .core.prefix import PrefixIndex
from .core.request import SamplingParams, Sequence
from .core.rng import verify_uniforms
from .core.sampling import row_probs
from .core.scheduler import Scheduler
from .core.timing import Stopwatch
from .core.tree import children, path_tokens
from .core.verify import HostVerifyOutput, VerifyOutput
from .core.verify_rule import verify_drafts
from .core.verify_step import VerifyStep
from .drafting.base import DraftBatch, Drafter, NoDrafter
from .drafting.cost import CostModel
from .drafting.guided import GuidedDraft, propose_guided
from .drafting.lengths import draft_lengths
from .grammar.library import Grammars
from .grammar.walk import RoundWalk
from .launch import Carry, Launched
from .model.runner import ModelRunner
from .records import Completion, RoundRecord, StepOutput, completion, round_record


class SpecEngine:
    """`config` sizes the engine (max_num_seqs auto: the target runner's slots); `drafting` says how
    many tokens to draft (drafting.num_speculative_tokens, drafting.adaptive); `drafter` proposes them."""

    def __init__(self, target: ModelRunner, drafter: Drafter | None = None, config: EngineConfig | None = None,
                 eos_token_ids: list[int] = (), decode: Callable[[list[int]], str] | None = None,
                 drafting: DraftingConfig | None = None, grammars: Grammars | None = None):
        config = config or EngineConfig()
        if config.max_num_seqs == AUTO:
            config = target.sized(config)
        self.config = config
        self.drafting = drafting or DraftingConfig()
        self.target = target
        self.drafter: Drafter = drafter or NoDrafter("cpu")     # its empty drafts stay on the host
        draft_runner = self.drafter.draft_runner
        for name, runner in (("target", target), ("draft", draft_runner)):
            if runner is not None and runner.num_slots < config.max_num_seqs:
                raise ValueError(f"the {name} runner has {runner.num_slots} slots, fewer than "
                                 f"engine.max_num_seqs={config.max_num_seqs}")
            if runner is not None and runner.max_model_len < config.max_model_len:
                raise ValueError(f"the {name} runner holds {runner.max_model_len} positions per slot, fewer "
                                 f"than engine.max_model_len={config.max_model_len}")
        if draft_runner is not None and draft_runner.vocab_size != target.vocab_size:
            raise ValueError(f"draft vocabulary ({draft_runner.vocab_size}) does not match the "
                             f"target's ({target.vocab_size}): drafts must share the target's tokenizer")
        self.eos_token_ids = list(eos_token_ids)
        self.decode = decode
        self.grammars = grammars             # compiles response_format (None: requests may not have one)
        if grammars is not None and grammars.vocab_size != target.vocab_size:
            raise ValueError(f"grammar masks cover {grammars.vocab_size} tokens, the target's logits "
                             f"{target.vocab_size}")
        self.scheduler = Scheduler(self.config.max_num_seqs, self.config.max_prefill_tokens)
        self.costs = CostModel()
        self.costs_cached: bool | None = None     # the cost curves were read from the kernel cache (calibrate)
        self.lengths = draft_lengths(self.drafting.adaptive, self.drafting.num_speculative_tokens, self.costs,
                                     self.drafter.is_free)
        self.intake = Intake(self.config.max_model_len, target.vocab_size, grammars)   # request ids in flight
        self.num_steps = 0               # decoding steps (rounds) run
        self._grammar_time = Stopwatch()  # grammar work (masks, forced tokens, walks; with the `none`
                                          # drafter all of the draft phase), over all steps
        self.prefixes = PrefixIndex() if self.config.prefix_reuse else None
        self.ahead = RunAhead(target, self.config.run_ahead, self.config.max_model_len, self.drafter,
                              admit=self._admit, running=lambda: list(self.scheduler.running),
                              draft=self._draft, launch=self._launch)

    @property
    def run_ahead(self) -> bool:
        """Steps without drafts run ahead of their readback here (engine.run_ahead, ahead.py)."""
        return self.ahead.enabled

    @property
    def num_steps_ahead(self) -> int:
        """Of num_steps, those launched before the previous one was read back."""
        return self.ahead.num_steps

    @property
    def grammar_s(self) -> float:
        """Seconds in grammar work over all steps (masks, forced tokens, walks)."""
        return self._grammar_time.s

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None,
                    seed: int = 0) -> None:
        """Queue a request. Raises RequestError (naming the field) for bad input; the running batch is
        never touched by a rejected request."""
        self.scheduler.add(self.intake.sequence(request_id, prompt_ids, params, seed))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> None:
        """Forget every prompt prefix the slot store holds, so no later prompt reuses one (a benchmark's
        warm-up must not serve its timed run). Only between requests: raises while any is unfinished."""
        if self.has_unfinished():
            raise RuntimeError("reset_prefix_cache: requests are still running or queued")
        if self.prefixes is not None:
            self.prefixes = PrefixIndex()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests that hold no slot yet."""
        return len(self.scheduler.waiting)

    # ---- the round ------------------------------------------------------------------------------
    def step(self) -> StepOutput:
        """One round for every running sequence: admit -> draft -> verify -> commit -> emit. (Where
        steps run ahead, `self.ahead` holds the next step launched before this one's readback.)"""
        if self.lengths.needs_costs and not self.costs.is_calibrated:
            self.calibrate()
        step = self.ahead.take()
        if step is None:
            self._admit()
            batch = list(self.scheduler.running)
            if not batch:
                return StepOutput()
            step = self._launch(batch, *self._draft(batch))
        self.ahead.launch_after(step)
        out, verify_s = self._finish(step)
        observe_step(self.costs, step, verify_s)
        rounds, alive = self._commit(step, out, verify_s)
        finished = self._emit(alive)
        self.ahead.drop_ended()
        self.num_steps += 1
        return StepOutput(finished=finished, rounds=rounds)

    def calibrate(self, repeats: int = 3, fresh: bool = False) -> None:
        """Measure the adaptive policy's cost curves (CostModel.calibrate) for the target and the
        draft model, if any. Must run while no sequence holds a slot: it writes scratch KV. On CPU the
        curves are kept in the kernel cache (ModelRunner.measured): a later start of the same models,
        kernels, slots and draft length on this machine reads them (the run's steps rescale them online
        as ever); fresh: measure them again, and keep those for later starts."""
        if self.scheduler.running or self.scheduler.prefilling:
            raise RuntimeError("calibrate() needs an idle engine (no sequence holds a slot)")
        curves, self.costs_cached = measured_curves(self.target, self.drafter.draft_runner, self.config,
                                                    self.drafting, repeats, fresh)
        self.costs.use(curves)

    @property
    def _lazy_draft(self) -> bool:
        """The draft model prefills only sequences about to draft (Drafter.catch_up) where the length
        policy says so (adaptive): where it says g = 0 the draft model costs nothing, not even the
        prompt's KV."""
        return self.lengths.drafts_lazily

    def _admit(self) -> None:
        """Admit into free slots, then prefill this step's chunks for the target and (unless lazy) the
        drafter (admit.py)."""
        admit_and_prefill(self.scheduler, self.prefixes, self.target, self.drafter, not self._lazy_draft)

    def _draft(self, batch: list[Sequence]) -> tuple[GuidedDraft, RoundWalk | None, float, float]:
        """Draft lengths, the lazy draft catch-up, the proposal (with forced tokens and grammar cuts
        where rows are constrained). Returns the drafts, the round's grammar walk (None: no row is
        constrained), the phase's seconds and the catch-up's share of them (kept out of the draft
        cost model)."""
        with Stopwatch() as phase:
            lengths, catch_up_s = self._draft_lengths(batch), 0.0
            if self._lazy_draft:
                with Stopwatch() as catch_up:
                    lengths, num_prefilled = self.drafter.catch_up(batch, lengths, self.config.max_prefill_tokens)
                catch_up_s = catch_up.s if num_prefilled else 0.0
            # No device sync here: a model drafter reads its proposal back at its end anyway (each draft
            # step under a grammar), and the verify phase's time runs to the step's one readback (_finish).
            generators = [s.rng.draft for s in batch]
            walk = None
            if any(s.guide is not None for s in batch):
                with self._grammar_time:
                    walk = RoundWalk([s.guide for s in batch], self.grammars.words, self.target.vocab_size)
                    guided = propose_guided(self.drafter, batch, lengths, [self._room(s) for s in batch],
                                            generators, walk, self.drafting.forced_tokens, self.lengths.size_trees)
            else:
                proposal = self.lengths.size_trees(self.drafter.propose(batch, lengths, generators))
                zeros = [0] * len(batch)
                guided = GuidedDraft(drafts=proposal, num_forced_ahead=zeros, num_drafted=list(proposal.num_draft),
                                     num_forced_after=zeros)
        return guided, walk, phase.s, catch_up_s

    @property
    def _trees(self) -> bool:
        """The drafter proposes token trees (sized after proposing)."""
        return bool(self.drafting.tree.max_tokens) and self.drafting.free_method == self.drafting.method

    def _room(self, s: Sequence) -> int:
        """Proposal tokens at most: their KV stays within the context, and a single path's committed
        tokens within max_tokens (a tree's tokens are not all on one path: what it has accepted past
        max_tokens is cut at commit)."""
        context = self.config.max_model_len - s.num_tokens - 1
        return max(0, context if self._trees else min(s.params.max_tokens - len(s.output_ids) - 1, context))

    def _draft_lengths(self, batch: list[Sequence]) -> list[int]:
        """g per sequence: fixed or adaptive, never past max_tokens or the context limit. Trees: their
        size in tokens, never past the context limit (their KV), or 0 for the whole step where the policy
        would keep none of any tree (rows under a grammar then propose only their forced tokens); a path
        accepted past max_tokens is cut at commit."""
        if self._trees:                 # a tree's depth is bounded by its size and the index, not by g
            size = self.lengths.tree_size(len(batch), self.drafting.tree.max_tokens)
            return [min(size, self._room(s)) for s in batch]
        wanted = self.lengths.lengths(batch, self.drafter.catch_up_lag)
        return [max(0, min(g, self._room(s))) for g, s in zip(wanted, batch)]

    def _launch(self, batch: list[Sequence], guided: GuidedDraft, walk: RoundWalk | None, draft_s: float,
                catch_up_s: float, carry: Carry | None = None) -> Launched:
        """One target forward over [last committed token, drafts] of every sequence, then the rule, with
        the step's one device-to-host readback started: in one graph where the runner has it for the
        step (ModelRunner.launch_verify), else the forward and then the rule, read back at once.
        carry: launched ahead of the step before (ahead.py), whose emitted tokens stay on the device."""
        drafts = guided.drafts
        with Stopwatch() as phase:
            starts, last = [s.num_computed for s in batch], [s.last_id for s in batch]
            if carry is not None:
                carry.place(starts, last)
            inputs = [[t] + drafts.tokens(b) for b, t in enumerate(last)]
            slots = [s.slot for s in batch]
            uniforms = (None if all(s.params.is_greedy for s in batch)
                        else verify_uniforms(batch, drafts.num_draft))
            with self._grammar_time:   # [sum(g + 1), words] on the host
                allowed = walk.target_allowed(drafts.num_draft, "cpu") if walk is not None else None
            penalties = any(s.params.has_penalties for s in batch)
            step = VerifyStep(drafts.proposals, [s.params for s in batch], uniforms, allowed, drafts.draft_probs,
                              drafts.parents, [(s.prompt_ids, s.output_ids) for s in batch] if penalties else None,
                              slots if penalties else None)
            readback = self.target.launch_verify(slots, starts, inputs, step,
                                                 carry.on_device() if carry is not None else None)
            out = None
            if readback is None:
                if carry is not None:
                    carry.fill(inputs)
                drafts = drafts.to(self.target.device)     # the graph takes them from the step's host data
                logits = self.target.forward(slots, starts, inputs, parents=drafts.parents)
                allowed = None if allowed is None else allowed.to(logits.device)
                out = self._verify_rule(batch, drafts, logits, inputs, allowed, uniforms).to_host()
        return Launched(batch, guided, walk, starts, inputs, draft_s, catch_up_s, phase.s, readback, out)

    def _finish(self, step: Launched) -> tuple[HostVerifyOutput, float]:
        """The step's verifier output, read back (the step's one device-to-host wait), and a tree's accepted
        paths' KV moved next to the committed tokens. Returns it and the verify phase's seconds (the
        launch and this wait)."""
        with Stopwatch() as wait:
            out = step.out if step.readback is None else step.readback.result()
            if step.guided.drafts.is_tree:
                self.target.move_path([s.slot for s in step.batch], step.starts,
                                      [[i + 1 for i in path[:k]] for path, k in zip(out.path, out.num_accepted)])
        return out, step.launch_s + wait.s

    def _verify_rule(self, batch: list[Sequence], drafts: DraftBatch, logits: torch.Tensor,
                     inputs: list[list[int]], allowed: torch.Tensor | None = None,
                     uniforms: tuple[torch.Tensor, torch.Tensor] | None = None) -> VerifyOutput:
        """Greedy rule, or rejection sampling with each sequence's verify uniforms (host, drawn by
        verify_uniforms: core/rng.py), on p processed per row on that row's own prefix (the round's
        inputs before it), masked by `allowed` (the rows' grammar masks, or None)."""
        row_seqs = [s for s, toks in zip(batch, inputs) for _ in toks]
        prefixes = [path for b, toks in enumerate(inputs) for path in path_tokens(drafts.parents_of(b), toks[1:])]
        greedy = [s.params.is_greedy for s in batch]
        if all(greedy):                                 # argmax only: no vocabulary-sized rows
            target_rows = row_probs(logits, row_seqs, prefixes, argmax_only=True, allowed=allowed)
        else:
            target_rows = row_probs(logits, row_seqs, prefixes, allowed=allowed)     # [num_draft + num_seqs, vocab]
            uniforms = tuple(u.to(target_rows.device) for u in uniforms)
        return verify_drafts(drafts.draft_ids, drafts.cu_num_draft, drafts.num_draft, drafts.parents, target_rows,
                             drafts.draft_probs, greedy, uniforms)

    def _commit(self, step: Launched, out: HostVerifyOutput, verify_s: float) -> tuple[list[RoundRecord],
                                                                                    list[Sequence]]:
        """Each row's accepted + recovered/bonus tokens committed up to any stop, its KV length and
        grammar walk rolled back to them (the drafter's in on_commit), the length policy told what was
        accepted, the round recorded. A row that ended in the step before (this step ran ahead of its
        readback) commits nothing. Returns the round records and the rows that committed."""
        rounds, alive, cu = [], [], [0, *itertools.accumulate(step.guided.drafts.num_draft)]
        for b, seq in enumerate(step.batch):
            if seq.is_finished:
                continue
            alive.append(seq)
            emitted = self._commit_tokens(step, out, b, seq)
            rejected = self._observe_acceptance(step, out, b, seq)
            rounds.append(round_record(step, out, b, seq, emitted, out.is_accepted[cu[b]:cu[b + 1]], rejected,
                                       verify_s, self.num_steps))
        self.drafter.on_commit(alive)
        return rounds, alive

    def _commit_tokens(self, step: Launched, out: HostVerifyOutput, b: int, seq: Sequence) -> int:
        """Row b's tokens committed (the grammar walk settled on them), its KV length rolled back to the
        committed history. Returns how many were committed before any stop."""
        k = out.num_accepted[b]
        tokens = out.output_ids[b][:k + 1]
        with self._grammar_time:
            may_stop = step.walk.settle(b, tokens[:k], tokens[-1]) if seq.guide is not None else None
        emitted = seq.commit(tokens, self.eos_token_ids, self.config.max_model_len, self.decode, may_stop)
        seq.num_computed = min(step.starts[b] + len(step.inputs[b]), seq.num_tokens - 1)   # rollback = a length
        return emitted

    def _observe_acceptance(self, step: Launched, out: HostVerifyOutput, b: int, seq: Sequence) -> bool:
        """The length policy told row b's drafted and accepted tokens (the grammar's forced ones left
        out); returns whether a draft token was rejected (a tree: the accepted path ends where the tree
        goes on)."""
        guided, drafts, k = step.guided, step.guided.drafts, out.num_accepted[b]
        ahead, drafted = guided.num_forced_ahead[b], guided.num_drafted[b]
        if drafts.is_tree:
            rejected = bool(children(drafts.parents[b])[(out.path[b][k - 1] if k else -1) + 1])
            drafted_accepted = max(0, k - ahead)        # below the forced tokens ahead
            self.lengths.update(seq, drafted_accepted + int(rejected), drafted_accepted)
        else:
            rejected = k < drafts.num_draft[b]
            self.lengths.update(seq, drafted, max(0, min(k - ahead, drafted)))
        if drafts.plans is not None:
            self.lengths.observe_tree(drafts.plans[b].probs, drafts.plans[b].parents, k)
        return rejected

    def _emit(self, batch: list[Sequence]) -> list[Completion]:
        """Free the slots of finished sequences (in the scheduler and the drafter); their completions."""
        finished = [seq for seq in batch if seq.is_finished]
        for seq in finished:
            seq.guide = None                   # the grammar state goes with the slot
            self.scheduler.release(seq)
            self.drafter.release(seq)
            self.target.release(seq.slot)
            if self.prefixes is not None:
                self.prefixes.release(seq)
        return [self._completion(seq) for seq in finished]

    def _completion(self, seq: Sequence) -> Completion:
        self.intake.forget(seq.request_id)
        return completion(seq, self.decode)

    def run(self, on_step: Callable[[StepOutput], None] | None = None) -> list[Completion]:
        """Step until every queued request is finished; returns completions in finishing order."""
        done = []
        while self.has_unfinished():
            out = self.step()
            done.extend(out.finished)
            if on_step is not None:
                on_step(out)
        return done

