"""Assemble an engine from config: load target (+ draft) and tokenizer, build the drafter.

This is the one place that knows both the config tree and the engine's constructors; the engine
itself knows nothing about configs, files or tokenisers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..engine import (DraftingConfig, DraftModelDrafter, EngineConfig, HybridDrafter, Kernels, ModelRunner,
                      NgramDrafter, SpecEngine, SuffixDrafter, TreeParams)
from ..engine.grammar.library import Grammars
from ..engine.model.hf_config import reject_unsupported, text_config
from ..engine.parallel.steps import TensorParallel
from ..io.reader import storage_options
from ..io.storage import StorageConfig
from ..loading.hardware import DtypeChoice, resolve_dtype
from ..loading.models import ModelSpec, check_vocab_compatible, load_model, model_id
from ..loading.shards import load_model_shard
from .config import SAME, ModelsConfig

log = logging.getLogger(__name__)


@dataclass
class LoadedEngine:
    engine: SpecEngine
    tokenizer: object
    target_id: str
    draft_id: str | None
    dtype: DtypeChoice           # what `models.dtype` resolved to on this machine, and why
    draft_dtype: DtypeChoice | None = None   # likewise `models.draft_dtype`, with a draft model
    slots_reason: str | None = None          # how `engine.max_num_seqs: auto` was resolved, if it was

    def plan_lines(self) -> list[str]:
        """Each model's backend plan, for the job summary."""
        lines = [f"target ({self.dtype.dtype}): {self.engine.target.plan.describe()}"]
        runner = self.engine.drafter.draft_runner
        if runner is not None:
            lines.append(f"draft ({self.draft_dtype.dtype}): {runner.plan.describe()}")
        return lines


def eos_ids(model, tokenizer) -> list[int]:
    """EOS ids from the generation config (may be a list) and the tokenizer."""
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    ids.add(getattr(tokenizer, "eos_token_id", None))
    return sorted(i for i in ids if i is not None)


def resolve_draft_dtype(models: ModelsConfig, target: DtypeChoice) -> DtypeChoice:
    """The draft model's dtype: the target's for `same`, else resolved like the target's."""
    if models.draft_dtype == SAME:
        return DtypeChoice(target.dtype, f"same as the target's: {target.reason}")
    return resolve_dtype(models.draft_dtype, models.device)


def build_engine(models: ModelsConfig, drafting: DraftingConfig, engine_cfg: EngineConfig,
                 kernels: Kernels | None = None, storage: StorageConfig | None = None,
                 tp: TensorParallel | None = None) -> LoadedEngine:
    """Load target (+ draft) in the dtypes `models.dtype` / `models.draft_dtype` resolve to on this
    machine's hardware; size the slot stores (engine.max_num_seqs, auto: from both models' KV needs);
    build the runners on the backend plan and the drafter `drafting.method` names. `storage`: access
    to models kept in object storage. tp: rank 0's place in a tensor-parallel replica (job/replica.py):
    the target is then rank 0's part, read by slices, and every rank runs each target forward."""
    storage = storage or StorageConfig()

    def options(source: str) -> dict | None:
        return storage_options(source, storage) if "://" in source else None
    dtype = resolve_dtype(models.dtype, models.device)
    spec = ModelSpec(models.target, dtype.dtype, models.device, models.trust_remote_code, options(models.target))
    target, tokenizer = load_model(spec) if tp is None or tp.size == 1 else load_model_shard(spec, tp.size, 0)[:2]
    reject_unsupported(target.config)
    draft, draft_id, draft_dtype = None, None, None
    if drafting.uses_draft_model:
        draft_dtype = resolve_draft_dtype(models, dtype)
        dspec = ModelSpec(models.draft, draft_dtype.dtype, models.device, models.trust_remote_code,
                          options(models.draft))
        draft, draft_tok = load_model(dspec)
        check_vocab_compatible(target, draft, tokenizer, draft_tok)
        reject_unsupported(draft.config)
        draft_id = model_id(dspec)
    eos = eos_ids(target, tokenizer)
    engine = assemble_engine(target, draft, drafting, engine_cfg, kernels, eos,
                             decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                             grammars=grammars_for(tokenizer, text_config(target.config).vocab_size, eos), tp=tp)
    return LoadedEngine(engine=engine, tokenizer=tokenizer, target_id=model_id(spec), draft_id=draft_id,
                        dtype=dtype, draft_dtype=draft_dtype, slots_reason=engine.target.slots_reason)


def assemble_engine(target, draft, drafting: DraftingConfig, engine_cfg: EngineConfig, kernels: Kernels | None = None,
                    eos: list[int] = (), decode=None, grammars: Grammars | None = None,
                    tp: TensorParallel | None = None) -> SpecEngine:
    """The engine over loaded models (`draft`: the draft model where drafting.method runs one, else
    None): each model on its own runner, the drafter drafting.method names. engine_cfg.max_num_seqs
    auto is resolved by the target's runner (model/slots.py: the KV of both models bounds it; on CPU
    the runner keeps the fewest sequences near its best measured tokens/s), and the draft's follows.
    tp: the target is rank 0's part of a tensor-parallel replica; the draft runs whole, on rank 0."""
    if drafting.uses_draft_model != (draft is not None):
        raise ValueError(f"drafting.method={drafting.method!r} " + ("needs a draft model" if draft is None
                                                                    else "runs no draft model"))
    runner = ModelRunner(target, engine_cfg, kernels, beside=(draft,) if draft is not None else (), tp=tp)
    engine_cfg = runner.sized(engine_cfg)
    drafter = DraftModelDrafter(ModelRunner(draft, engine_cfg, kernels), drafting.draft_sample_method) if draft else None
    if drafting.free_method is not None:
        free = free_drafter(drafting, drafting.free_method, runner.device)
        drafter = HybridDrafter(free, drafter) if drafter is not None else free
    return SpecEngine(runner, drafter, engine_cfg, eos_token_ids=list(eos), decode=decode, drafting=drafting,
                      grammars=grammars)


def grammars_for(tokenizer, vocab_size: int, eos: list[int]) -> Grammars | None:
    """response_format support for this tokenizer (llguidance reads fast tokenizers only); without
    it, a row asking for a format becomes an error row saying so."""
    try:
        return Grammars.from_hf(tokenizer, vocab_size, eos)
    except Exception as e:  # noqa: BLE001 -- free-text rows must still run
        log.warning("no response_format support for this tokenizer: %s", e)
        return None


def free_drafter(drafting: DraftingConfig, kind: str, device: str) -> NgramDrafter | SuffixDrafter:
    """The model-free drafter `kind` (ngram | suffix), alone (with token trees where configured) or as
    hybrid's first part (single paths: the model's part drafts paths)."""
    tree = drafting.tree if drafting.method == kind else TreeParams()
    if kind == "suffix":
        return SuffixDrafter(drafting.suffix, device=device, tree=tree)
    return NgramDrafter(drafting.ngram_min, drafting.ngram_max, device=device, tree=tree)
