"""Runs a Hugging Face decoder (Llama, Qwen2/3, Mistral, SmolLM...) over a slot KV store.

One ModelRunner per model (target, draft). A forward takes a ragged batch: for each row a slot, the
position of its first new token, and its new tokens. Tokens are packed flat, so a verify step costs
the sum of the rows' lengths, not batch x the longest. The runner counts every real token
it forwards, so tests can prove accepted tokens are never recomputed.

This module knows nothing about requests, drafting or sampling.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import asdict, replace
from typing import Callable

import torch

from ..backends.cpu.attention import RowAttention, amx_kernel as amx_attention
from ..backends.cpu.attention import amx_unavailable as amx_attention_unavailable
from ..backends.cpu.calibrate import (Calibration, MlpPlan, cached_measurement, calibrate, calibrate_attention,
                                      calibrate_mlp, measuring_alone)
from ..backends.cpu.decoder import policy as cpu_decoder_policy
from ..backends.cpu.decoder import unsupported as cpu_decoder_unsupported
from ..backends.cpu.fused import fuse, silu_mlps
from ..backends.cpu.linear import (AMX, ONEDNN, PANEL_KIND, TORCH, LinearPlan, PlannedLinear, amx_kernel,
                                   amx_unavailable, can_pack, family_weights, planned_linears)
from ..backends.compiled import compile_layers, uncompile_layers
from ..backends.cuda.graphs import MAX_TOKENS, UNCAPTURED, CudaCapture, StepGraphs
from ..backends.flex import BLOCK, block_tables, capacity, prefer_flex
from ..config import AUTO, EngineConfig
from ..core.timing import interleaved
from ..core.tree import is_chain
from ..core.verify import HostVerifyOutput
from ..core.verify_step import Readback, SlotCounts, Tail, VerifyStep, tail_spec
from ..kv.layout import attention_masks, make_layout
from ..kv.store import SlotKVCache
from ..parallel.shard import install_collectives
from ..parallel.steps import TensorParallel
from .attention import ATTENTION_NAME, attending, register_attention
from .hf_config import attention_features, head_dim, kv_heads, reject_unsupported, text_config
from .plan import BackendPlan, Backends, Kernels, choose_backends, cpu_lacks
from .slots import (KNEE_SHARE, MEMORY_SHARE, free_memory, knee, measuring_context, probe_limit, probe_rows,
                    resolve_max_num_seqs)


def cache_kwarg(model) -> str:
    """The keyword a model's forward takes its KV cache by: `cache` (transformers >= 5.2x) or
    `past_key_values` (earlier releases, e.g. 5.17, which ignore an unknown `cache`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def weight_bytes(model) -> int:
    """Bytes the model's parameters hold (each tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class ModelRunner:
    """One model over its slot store. `config.max_num_seqs` slots (auto: model/slots.py resolves it for
    this model's KV and that of the models `beside` it, which keep as many slots) of
    `config.max_model_len` positions; the kernels come from the backend plan (plan.py): `kernels`
    overrides the per-kernel switches that `config.kernels` implies (tests and benchmarks).

    tp: the runner's place in a tensor-parallel replica (parallel/): `model` is then this rank's shard,
    its attention and MLP outputs all-reduced and its logits gathered on rank 0, and on rank 0 every
    forward and KV move is first sent to the other ranks (parallel/steps.py), with the forward path
    rank 0 chose (the CPU loop or the modules), so every rank runs the same collectives. At more than
    one rank compiled layers and CUDA graphs stay off (they hold no collectives), and auto slots are
    bounded by memory, not measured."""

    def __init__(self, model, config: EngineConfig | None = None, kernels: Kernels | None = None,
                 beside: tuple = (), tp: TensorParallel | None = None):
        config = config or EngineConfig()
        kernels = kernels or Kernels.of(config.kernels)
        reject_unsupported(model.config)        # a family the engine is not checked against: refused, named
        self.tp = tp if tp is not None and tp.size > 1 else None
        # the model's weights as loaded, counted once, here (our kernels may hold them in other layouts from
        # here on); rank -> bytes: this rank's, and on rank 0 of a replica every rank's (gathered below)
        self.weight_bytes = weight_bytes(model)
        self.rank_weight_bytes = {self.tp.group.rank if self.tp is not None else 0: self.weight_bytes}
        if self.tp is not None:
            if kernels.linear_plan is not None:
                raise ValueError("a forced linear_plan is not sent to a tensor-parallel replica's ranks")
            kernels = replace(kernels, compiled_layers="off", uncaptured_graphs=False)
            config = replace(config, cuda_graphs="off")
        cfg = text_config(model.config)
        head_size = head_dim(cfg)
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = cfg.vocab_size
        self.num_groups = cfg.num_attention_heads // kv_heads(cfg)
        self.max_model_len = max_model_len = config.max_model_len
        auto = config.max_num_seqs == AUTO
        n, self.slots_reason = resolve_max_num_seqs(config.max_num_seqs, [model, *beside], max_model_len)
        if auto:
            config = replace(config, max_num_seqs=n)
        self.num_slots = num_slots = config.max_num_seqs
        chosen = choose_backends(config, kernels, self.device, self.dtype, head_size)
        # soft-capping, sinks, a sliding window: the padded path computes them, FlexAttention all but sinks
        # (they need its logsumexp, which inductor's CPU kernel does not return), our CPU kernel (and the loop
        # over it) none: those step aside (the plan line names the features)
        self.attention_features = attention_features(model, max_model_len)
        features = self.attention_features
        if features and kernels.cpu_attention == "on":
            raise ValueError(f"cpu_attention=on, but {type(model).__name__}'s attention has {features.describe()}, "
                             f"which our CPU attention kernel does not compute")
        if features:
            chosen = replace(chosen, attention=None, flex=None if features.sinks else chosen.flex)
        # flex: attention per row over its own key blocks, always or on steps where that is cheaper than
        # padded SDPA, which is every other step's kernel; cpu_attention: our C kernel (None: not used)
        self.flex, self.cpu_attention = chosen.flex, chosen.attention
        # auto: rows of many new tokens go to our AMX kernel or torch's flash attention where that measured
        # faster here
        self.attention_plan = None
        if self.cpu_attention is not None and kernels.cpu_attention == "auto":
            amx = amx_attention() if amx_attention_unavailable(self.device, self.dtype, head_size) is None else None
            self.attention_plan = plan = calibrate_attention(self.cpu_attention, cfg.num_attention_heads,
                                                             kv_heads(cfg), head_size, self.dtype, amx=amx)
            if plan.long_from is not None:
                self.cpu_attention = RowAttention(self.cpu_attention, plan.long_from,
                                                  amx if plan.long_kind == "amx" else None)
        # CUDA graphs: their pad rows and tokens need one spare slot and a few positions past max_model_len
        store_slots = StepGraphs.store_rows(num_slots) if chosen.graphs else num_slots
        store_len = StepGraphs.store_positions(max_model_len) if chosen.graphs else max_model_len
        self._store = lambda slots, positions=store_len: SlotKVCache(
            cfg.num_hidden_layers, slots, kv_heads(cfg), capacity(positions) if self.flex else positions,
            head_size, self.dtype, self.device)
        # auto on CPU: the slots are measured (_fit_slots) on a store of the few positions the measuring
        # steps use, and the store of max_model_len positions is made for the slots kept
        measure = auto and self.device.type == "cpu" and not chosen.graphs and self.tp is None
        self.cache = self._store(store_slots, measuring_context(max_model_len) + 1 if measure else store_len)
        self.num_forward_tokens = 0        # real tokens forwarded, all time
        self.plain_steps: dict[int, float] = {}   # rows -> s of a one-token step at measuring_context (_fit_slots)
        self._counts: SlotCounts | None = None   # penalty counts per slot (forward_verify)
        self._draft_q: torch.Tensor | None = None   # every verify tail's dense q rows (forward_verify)
        self.cache_kwarg = cache_kwarg(model)
        self.kernels = kernels
        self._apply(model, chosen, kernels, config.max_prefill_tokens)
        # The graphs replay the model's forward with torch's padded attention: not where our CPU kernels
        # (or the CPU loop over them) take every forward.
        self.graphs = (StepGraphs(self._model_forward, self.num_groups, self.dtype, self.device, num_slots,
                                  self.cache.max_len, CudaCapture(self.device) if chosen.capture_graphs else None,
                                  self._flex_tables if self.flex else None)
                       if chosen.graphs and self.decoder is None and self.cpu_attention is None else None)
        self._chosen = chosen
        self.plan = self._plan(chosen)
        if measure:
            self._fit_slots()
        if self.tp is not None and self.tp.peers is not None:     # rank 0: the other ranks build theirs
            kernel_fields = {**{k: v for k, v in asdict(kernels).items() if k != "linear_plan"},
                             "cpu_decoder": "off" if self.decoder is None else "on"}
            self.rank_weight_bytes = self.tp.peers.runner(asdict(config), kernel_fields, self.tp.timeout_s,
                                                          self.weight_bytes)

    def sized(self, config: EngineConfig) -> EngineConfig:
        """`config` with engine.max_num_seqs as this runner resolved it (auto: the slots it kept): the one
        answer the engine and a draft model's runner follow."""
        return config if config.max_num_seqs == self.num_slots else replace(config, max_num_seqs=self.num_slots)

    def _fit_slots(self, repeats: int = 3) -> None:
        """Keep the fewest slots that reach KNEE_SHARE of the best plain-decoding tokens/s measured on
        this runner (slots.py): steps of 1, 2, 4, ... rows of one token at measuring_context, up to the slots
        it has, timed in turn (_step_seconds); then the store of max_model_len positions for those slots.
        The rates are kept in the kernel cache (measured) whatever memory bounded them: a later start of
        this model and plan on this machine reads those up to its own bound (two workers of a node with a
        little more or less memory free keep the same count, the second measuring nothing), and measures
        again where its bound reaches further. The steps up to the slots kept stay in `plain_steps`: the
        adaptive policy's cost curve takes them (Engine.calibrate) rather than timing the same forwards again."""
        context = measuring_context(self.max_model_len)
        rows = probe_rows(probe_limit(self.num_slots))
        fields = {"context": context, "repeats": repeats, "rounds": "in turn"}

        def measure() -> list[list[float]]:
            with measuring_alone("slot-steps"):           # workers starting together: one at a time
                return [[r, r / s] for r, s in zip(rows, self._step_seconds(rows, context, repeats))]
        measured, cached = self.measured("slot-rates", fields, measure)
        if max(r for r, _ in measured) < rows[-1]:       # measured where less memory was free: ours reach further
            measured, cached = self.measured("slot-rates", fields, measure, fresh=True)
        rates = [(int(r), float(t)) for r, t in measured if r <= rows[-1]]
        n = knee(rates)
        self.plain_steps = {r: r / t for r, t in rates if r <= n}
        self.num_forward_tokens = 0
        self.cache = self._store(n)
        if self.decoder is not None:
            self.decoder.cache = self.cache
        self.num_slots = n
        shown = ", ".join(f"{r}: {t:.0f}" for r, t in rates)
        why = (f"{'cached' if cached else 'measured'} tokens/s of plain steps by rows at context {context} "
               f"({shown}): {n}, the fewest within {1 - KNEE_SHARE:.0%} of the best")
        self.slots_reason = why if self.slots_reason is None else f"{self.slots_reason}; {why}"

    def identity(self) -> dict:
        """What the time of this runner's forwards depends on besides the machine: the model's shape, the
        dtype, the device and the kernels that run it (their plans, not how long measuring took, and the
        keys of the measurements behind them, which name our kernels' builds)."""
        cfg = text_config(self.model.config)
        shape = {k: getattr(cfg, k, None) for k in ("model_type", "hidden_size", "intermediate_size",
                                                    "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim", "vocab_size")}
        plan = {k: v for k, v in self._plan(self._chosen, how=False).__dict__.items() if k != "modules_why"}
        keys = [p.key for p in (self.calibration, self.attention_plan, self.mlp_plan) if p is not None]
        return {"model": shape, "dtype": str(self.dtype), "device": str(self.device), "plan": plan, "measured": keys}

    def measured(self, name: str, fields: dict, measure: Callable[[], object],
                 fresh: bool = False) -> tuple[object, bool]:
        """(`measure()`'s result, whether it was read from the kernel cache): on CPU kept there under this
        runner's identity and `fields`, so the next start of the same model and kernels on this machine
        reads it in milliseconds (fresh: measured now all the same, and kept for those starts); elsewhere
        measured each time (a GPU's forwards take milliseconds)."""
        if self.device.type != "cpu":
            return measure(), False
        return cached_measurement(name, {"runner": self.identity(), **fields}, measure, fresh=fresh)

    def _step_seconds(self, rows: list[int], context: int, repeats: int) -> list[float]:
        """Seconds of a plain decoding step of each row count (one token per row at `context`, scratch KV
        in the first slots): the median of `repeats` rounds, each timing every row count once (in turn, so
        a stretch where the machine is busy elsewhere slows one timing of several sizes, not every timing
        of one). No warm-up round: the median sets aside a first call's one-off costs as it does a
        disturbed one."""
        def step(n: int) -> None:
            self.forward(list(range(n)), [context] * n, [[0]] * n, logits="last")
            self.synchronize()
        return interleaved([lambda n=n: step(n) for n in rows], repeats, warmups=0)

    def _apply(self, model, chosen: Backends, kernels: Kernels, prefill_rows: int) -> None:
        """Apply the chosen kernels to the model, in place, in the order they depend on each other."""
        # RMSNorms and SiLU MLPs as one pass each, gate and up as one linear, before the linears are
        # swapped below (the merged gate/up is a plain nn.Linear)
        self.cpu_fused = chosen.fused
        self.mlp_plan: MlpPlan | None = None
        merge = True
        mlps = silu_mlps(model) if chosen.fused is not None and kernels.cpu_fused == "auto" else []
        if mlps:
            self.mlp_plan = calibrate_mlp(mlps[0], chosen.fused)     # auto: the form measured faster here
            merge = self.mlp_plan.merged
        self.fused_norms, self.fused_mlps = fuse(model, chosen.fused, merge) if chosen.fused is not None else (0, 0)
        # Linear weights held in the layout of each kernel the plan runs them with: our panel kernel for
        # few rows, oneDNN's packed linear (AMX tiles where the CPU has them) for many, as measured on this
        # machine (backends/cpu/calibrate.py); a step then streams the weights at memory speed, and
        # verifying a few tokens per sequence costs little more than one. Without packed_linear: F.linear.
        self.cpu_linear = chosen.linear
        self.calibration: Calibration | None = None
        self.amx = None                   # our AMX kernel, where the plan may take it
        plans = self._linear_plans(model, chosen, kernels, prefill_rows)
        self.planned = planned_linears(model, plans, chosen.linear, self.amx) if plans else 0
        planned = [m for m in model.modules() if type(m) is PlannedLinear]
        self.panel_linears = sum(PANEL_KIND in m.plan.kinds or AMX in m.plan.kinds for m in planned)
        self.packed_linears = sum(ONEDNN in m.plan.kinds for m in planned)
        # Attention through the slot store. Calls without `slot_layout` (e.g. HF generate on the same
        # model object) fall through to SDPA, so the model stays usable elsewhere.
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        # With all of the above in place: the forward as one loop over those kernels, RoPE and the KV
        # write in one pass, q/k/v as one linear; the same numbers as the model's forward, without its glue.
        self.decoder = cpu_decoder_policy(kernels.cpu_decoder, model, self.cache, self.cpu_attention, chosen.fused,
                                          self.attention_features.describe(),
                                          *((self.tp.group.all_reduce, self.tp.group.gather_last) if self.tp else ()))
        self.modules_why = ""
        if self.decoder is None and kernels.cpu_decoder == "auto" and self.device.type == "cpu":
            self.modules_why = cpu_decoder_unsupported(model, self.cpu_attention, chosen.fused,
                                                       self.attention_features.describe()) or ""
        # Each decoder layer compiled (its norms, RoPE, residual adds and SiLU product fused): where the
        # modules run the forward (no CPU loop), on CUDA by default
        self.compiled_layers = compile_layers(model) if chosen.compiled_layers and self.decoder is None else 0
        # A replica's collectives on the modules as they now run: our kernels compute each rank's shard
        if self.tp is not None:
            install_collectives(model, self.tp.group)
        self.layers_off_reason: str | None = None

    def _linear_plans(self, model, chosen: Backends, kernels: Kernels,
                      prefill_rows: int) -> dict[str, LinearPlan] | None:
        """Each family's plan (linear.py's FAMILIES): cpu_linear on: the panel kernel at every row count;
        off: oneDNN's packed linear; auto: measured here among the kernels that run (calibrate.py),
        with a second copy of a family's weights only where it fits in the memory share of the KV stores.
        prefill_rows: the engine's prefill step (max_prefill_tokens), one more row count to time.
        None: torch's modules as they are (packed_linear off, or nothing of ours runs here)."""
        weights = family_weights(model)
        if not kernels.packed_linear or self.device.type != "cpu" or not weights:
            return None          # (no nn.Linear left: a model another runner has planned already)
        if kernels.linear_plan is not None:
            if AMX in kernels.linear_plan.kinds:
                self.amx = amx_kernel()
            return {f: kernels.linear_plan for f in weights}
        packs = can_pack(self.device, self.dtype)
        if kernels.cpu_linear == "on" or (kernels.cpu_linear == "off" and packs):
            kind = PANEL_KIND if kernels.cpu_linear == "on" else ONEDNN
            return {f: LinearPlan.single(kind) for f in weights}
        # F.linear only where oneDNN cannot pack: it runs oneDNN's or MKL's kernels on the dense weight;
        # our AMX kernel where the CPU has AMX tiles and the panel kernel runs (it reads the same panels)
        if chosen.linear is not None and amx_unavailable(self.device, weights) is None:
            self.amx = amx_kernel()
        kinds = tuple(k for k, ok in ((PANEL_KIND, chosen.linear is not None), (AMX, self.amx is not None),
                                      (ONEDNN, packs), (TORCH, not packs)) if ok)
        if kernels.cpu_linear == "off" or kinds == (TORCH,):
            return None
        shapes = {f: [tuple(w.shape) for w in ws] for f, ws in weights.items()}
        budget = int(free_memory(self.device) * MEMORY_SHARE["cpu"])
        self.calibration = calibrate(weights, shapes, kinds, chosen.linear, amx=self.amx,
                                     prefill_rows=prefill_rows).within(budget)
        return self.calibration.plans

    def _plan(self, chosen: Backends, how: bool = True) -> BackendPlan:
        """What runs the forwards; how: with whether each measured plan was measured or read from the cache."""
        attention = (self.attention_plan.describe(how) if self.attention_plan is not None else
                     "cpu-kernel" if self.cpu_attention is not None else
                     {"always": "flex", "cheaper": "flex-where-cheaper"}.get(self.flex, "sdpa"))
        if self.attention_features:
            aside = "our CPU kernel and FlexAttention do" if self.attention_features.sinks else "our CPU kernel does"
            attention += f" ({self.attention_features.describe()}; {aside} not compute them)"
        forced = self.kernels.linear_plan
        earlier = next((m.plan for m in self.model.modules() if type(m) is PlannedLinear), None)
        linear = (("torch" if earlier is None else f"planned earlier: {earlier.describe()}") if not self.planned
                  else self.calibration.describe(how) if self.calibration is not None
                  else f"planned: {forced.describe()}" if forced is not None
                  else f"panel-{str(self.dtype).removeprefix('torch.')}" if self.panel_linears else "onednn-packed")
        graphs = "off" if self.graphs is None else "captured" if chosen.capture_graphs else "uncaptured"
        mlp = (self.mlp_plan.describe(how) if self.mlp_plan is not None
               else "merged gate/up + silu_mul" if self.fused_mlps else "modules")
        return BackendPlan(attention, linear, "fused" if self.fused_norms else "modules", mlp,
                           "cpu-loop" if self.decoder is not None else "modules", graphs,
                           "compiled" if self.compiled_layers else "modules", cpu_lacks(self.device, self.dtype),
                           self.modules_why)

    @torch.inference_mode()
    def forward(self, slots: list[int], starts: list[int], tokens: list[list[int]],
                logits: str = "all", parents: list[list[int] | None] | None = None,
                last_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Compute KV for tokens[b] at positions starts[b]... of slot slots[b]. Returns float logits for
        every real token in row order ([sum(len), vocab]), for the last token of each row
        ([rows, vocab]), or None (logits="none": prefill). parents[b]: row b is a token tree, its
        first token the root and the rest draft tokens with these parents (core/tree.py: RoPE at
        start + depth, each token attending to its ancestors only); then `move_path` keeps one path.
        last_tokens: [rows] int64 on the device, each row's last token in place of tokens[b][-1] (a
        placeholder): a draft model's next input, which the host has not read back."""
        with self._mirrored("forward", slots=slots, starts=starts, tokens=tokens, logits=logits, parents=parents):
            return self._forward(slots, starts, tokens, logits, parents, last_tokens)

    def _mirrored(self, op: str, **args):
        """On rank 0 of a tensor-parallel replica: `op` sent to every rank, which run it beside this one."""
        if self.tp is None or self.tp.peers is None:
            return contextlib.nullcontext()
        return self.tp.peers.step(op, **args)

    def _forward(self, slots, starts, tokens, logits, parents, last_tokens) -> torch.Tensor | None:
        num_new = [len(t) for t in tokens]
        kernel = self.cpu_attention
        if parents is not None and all(p is None or is_chain(p) for p in parents):
            parents = None
        bucket = (self.graphs.bucket(starts, num_new, logits, tree=parents is not None)
                  if self.graphs is not None else None)
        if bucket is not None:
            out = self.graphs.forward(bucket, slots, starts, tokens, parents, last_tokens)
            self.num_forward_tokens += sum(num_new)
            return out.float()
        if self.decoder is not None:
            out = self.decoder.forward(make_layout(slots, starts, tokens, self.device, kernel=kernel,
                                                   parents=parents, last_tokens=last_tokens), logits)
            self.num_forward_tokens += sum(num_new)
            return None if out is None else out.float()
        flex = kernel is None and (self.flex == "always" or (self.flex == "cheaper" and prefer_flex(
            [s + n for s, n in zip(starts, num_new)], self.device)))
        layout = make_layout(slots, starts, tokens, self.device, flex=flex, kernel=kernel, parents=parents,
                             last_tokens=last_tokens)
        if flex:
            layout.flex = self._flex_tables(layout)
        # Positions to compute logits for: 0 (every token), else a 1D index tensor, the form every
        # transformers 5 release reads the same way (a boolean mask is only understood by recent ones);
        # "none" keeps one, as HF needs >= 1.
        keep = 0 if logits == "all" else (layout.row_ends if logits == "last" else layout.row_ends[:1])
        mask = None
        if not flex and kernel is None:
            mask, layout.rest_mask = attention_masks(layout, self.num_groups, self.dtype)
        out = self._model_forward(layout, mask, keep)
        self.num_forward_tokens += sum(num_new)
        return None if logits == "none" else out.float()                     # [kept, vocab]

    @torch.inference_mode()
    def forward_verify(self, slots: list[int], starts: list[int], tokens: list[list[int]],
                       step: VerifyStep) -> HostVerifyOutput | None:
        """A verify step (tokens[b]: the last committed token, then step.proposals[b], a path or a tree):
        the forward, the logits' processing and the rule in one graph (core/verify_step.py), its
        result read back once. None, having run nothing, where the step does not take that path (no
        graphs, tails off, a step past the buckets): then `forward` and the eager rule."""
        launched = self.launch_verify(slots, starts, tokens, step)
        return None if launched is None else launched.result()

    @torch.inference_mode()
    def launch_verify(self, slots: list[int], starts: list[int], tokens: list[list[int]], step: VerifyStep,
                      carry: tuple[torch.Tensor, list[tuple[int, int]]] | None = None) -> Readback | None:
        """forward_verify without waiting: the step is launched and its readback started; the Readback's
        result() waits for it. carry (tokens, pairs): rows whose last input the host has not read back,
        row b's taken from index i of that device tensor for each (b, i) (StepGraphs.forward_tail)."""
        if self.graphs is None or not self.kernels.graph_verify:
            return None
        spec = tail_spec(step, self.vocab_size)
        num_new = [len(t) for t in tokens]
        bucket = self.graphs.bucket(starts, num_new, "all", tree=spec.tree)
        if bucket is None:
            return None
        words = 0 if step.allowed is None else step.allowed.shape[1]
        tail = self.graphs.tail(bucket, (spec, words), lambda: Tail(
            bucket.rows, bucket.q, self.vocab_size, words, spec, self.device,
            self._q_buffer() if spec.dense_q else None, self._slot_counts() if spec.penalties else None))
        if tail is None:
            return None
        tail.load_q(step)
        out = self.graphs.forward_tail(bucket, slots, starts, tokens, tail, tail.host_bytes(step), step.parents,
                                       carry)
        self.num_forward_tokens += sum(num_new)
        return Readback(out, bucket.rows, bucket.q, step.num_draft, spec.tree)

    def _flex_tables(self, layout) -> tuple[torch.Tensor, ...]:
        """FlexAttention's block tables for a layout, from its row table on the device."""
        return block_tables(layout.slots, layout.row_table[1], layout.row_table[2], self.cache.num_slots,
                            layout.is_valid.shape[1], self.cache.max_len // BLOCK, tree=layout.tree is not None)

    def _slot_counts(self) -> SlotCounts:
        """Each slot's token counts for penalties inside the graph (made on first use)."""
        if self._counts is None:
            self._counts = SlotCounts(self.cache.num_slots, self.vocab_size, self.device)
        return self._counts

    def release(self, slot: int) -> None:
        """The slot's sequence is gone: what the runner kept for it (its penalty counts) goes too."""
        if self._counts is not None:
            self._counts.forget(slot)

    def _q_buffer(self) -> torch.Tensor:
        """Every tail's dense q rows ([MAX_TOKENS, vocab] float32, made on first use)."""
        if self._draft_q is None:
            self._draft_q = torch.zeros(MAX_TOKENS, self.vocab_size, dtype=torch.float32, device=self.device)
        return self._draft_q

    def _model_forward(self, layout, mask: torch.Tensor | None, keep) -> torch.Tensor:
        """The model's forward over the slot store for one layout: logits of the kept packed positions
        ([kept, vocab], the model's dtype)."""
        self.cache.layout = layout
        layout.window_masks = None
        call = lambda: self.model(input_ids=layout.input_ids, position_ids=layout.flat_position_ids,
                                  attention_mask=mask, use_cache=True, logits_to_keep=keep, slot_layout=layout,
                                  **{self.cache_kwarg: self.cache})
        try:
            with attending(layout):
                out = call()
        except Exception as exc:       # compiled layers that fail: the modules from now on, never a wrong result
            if not self.compiled_layers:
                raise
            self._uncompile(f"{type(exc).__name__}: {exc}")
            with attending(layout):
                out = call()               # rewrites whatever KV the failed forward wrote, with the same values
        finally:
            self.cache.layout = None
        return out.logits[0]

    def _uncompile(self, reason: str) -> None:
        uncompile_layers(self.model)
        self.compiled_layers, self.layers_off_reason = 0, reason
        if hasattr(self, "plan"):      # (a failure while the runner measures itself comes before its plan)
            self.plan = replace(self.plan, layers="modules")
        warnings.warn(f"compiled layers off for this model: {reason}; its modules run", RuntimeWarning, stacklevel=3)

    def move_path(self, slots: list[int], starts: list[int], paths: list[list[int]]) -> None:
        """After a tree step: row b's accepted path, the inputs paths[b] (increasing, past the root),
        gets its KV at positions starts[b] + 1, + 2, ... (contiguous after the root); the rest of the
        tree is left past the computed length (rolled back as a length). Counts no forwarded token."""
        with self._mirrored("move_path", slots=slots, starts=starts, paths=paths):
            self._move_path(slots, starts, paths)

    def _move_path(self, slots: list[int], starts: list[int], paths: list[list[int]]) -> None:
        src, dst, row_slots = [], [], []
        for slot, start, path in zip(slots, starts, paths):
            for j, inp in enumerate(path, start=1):
                if inp != j:
                    row_slots.append(slot)
                    src.append(start + inp)
                    dst.append(start + j)
        if src:
            as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
            self.cache.move_positions(as_t(row_slots), as_t(src), as_t(dst))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot `dst` gets slot `src`'s KV for positions [0, n): a shared prompt prefix, copied instead of
        computed (core/prefix.py). Counts no forwarded token."""
        with self._mirrored("copy_prefix", src=src, dst=dst, n=n):
            self.cache.copy_positions(src, dst, n)

    @property
    def pads_rows(self) -> bool:
        """Whether a forward's attention may pad every row to the longest (torch's SDPA path): then
        callers batching long rows of unequal length (prefill) should group them."""
        return self.cpu_attention is None and self.flex != "always"

    def synchronize(self) -> None:
        """Wait for queued device work, so wall-clock timings are honest on asynchronous devices."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def build_runner(model, num_slots: int, max_model_len: int, *, compile: str = "off", cuda_graphs: str = "off",
                 tp: TensorParallel | None = None, **switches) -> ModelRunner:
    """A runner with the per-kernel switches set one by one (Kernels' fields; cuda_graphs may also be
    UNCAPTURED): the seam tests and benchmarks use to force a path (tp: of a rank's shard). Jobs build
    runners from their config."""
    uncaptured = cuda_graphs == UNCAPTURED
    config = EngineConfig(max_num_seqs=num_slots, max_model_len=max_model_len, compile=compile,
                          cuda_graphs="off" if uncaptured else cuda_graphs)
    return ModelRunner(model, config, Kernels(**switches, uncaptured_graphs=uncaptured), tp=tp)
