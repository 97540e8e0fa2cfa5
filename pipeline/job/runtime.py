"""Assemble an engine from config: load target (+ draft) and tokenizer, build the drafter.

This is the one place that knows both the config tree and the engine's constructors; the engine
itself knows nothing about configs, files or tokenisers.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine import (
    DraftModelDrafter,
    HybridDrafter,
    ModelRunner,
    NgramDrafter,
    SpecEngine,
    SuffixDrafter,
)
from ..engine.model.hf_config import reject_unsupported
from ..loading.hardware import DtypeChoice, resolve_dtype
from ..loading.models import ModelSpec, check_vocab_compatible, load_model, model_id
from .config import SAME, EngineSection, ModelsConfig, uses_draft_model


@dataclass
class LoadedEngine:
    engine: SpecEngine
    tokenizer: object
    target_id: str
    draft_id: str | None
    dtype: DtypeChoice           # what `models.dtype` resolved to on this machine, and why
    draft_dtype: DtypeChoice | None = None   # likewise `models.draft_dtype`, with a draft model


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


def build_engine(models: ModelsConfig, engine_cfg: EngineSection) -> LoadedEngine:
    """Load target (+ draft) in the dtypes `models.dtype` / `models.draft_dtype` resolve to on this
    machine's hardware."""
    dtype = resolve_dtype(models.dtype, models.device)
    spec = ModelSpec(models.target, dtype.dtype, models.device, models.trust_remote_code)
    target, tokenizer = load_model(spec)
    reject_unsupported(target.config, engine_cfg.max_model_len)
    slots, max_len = engine_cfg.max_num_seqs, engine_cfg.max_model_len

    def runner(model) -> ModelRunner:
        return ModelRunner(model, slots, max_len, engine_cfg.packed_linear, engine_cfg.compile,
                           engine_cfg.cpu_attention, engine_cfg.cpu_linear, engine_cfg.cpu_fused,
                           engine_cfg.cpu_decoder, engine_cfg.cuda_graphs)

    drafter, draft_id, draft_dtype = None, None, None
    if uses_draft_model(models):
        draft_dtype = resolve_draft_dtype(models, dtype)
        dspec = ModelSpec(models.draft, draft_dtype.dtype, models.device, models.trust_remote_code)
        draft, draft_tok = load_model(dspec)
        check_vocab_compatible(target, draft, tokenizer, draft_tok)
        reject_unsupported(draft.config, max_len)
        drafter = DraftModelDrafter(runner(draft), models.draft_sample_method)
        draft_id = model_id(dspec)
    if models.drafter in ("ngram", "suffix", "hybrid"):
        free = free_drafter(models, models.hybrid_proposer if models.drafter == "hybrid" else models.drafter)
        drafter = HybridDrafter(free, drafter) if drafter is not None else free
    engine = SpecEngine(runner(target), drafter,
                        engine_cfg.to_engine_config(), eos_token_ids=eos_ids(target, tokenizer),
                        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    return LoadedEngine(engine, tokenizer, model_id(spec), draft_id, dtype, draft_dtype)


def free_drafter(models: ModelsConfig, kind: str) -> NgramDrafter | SuffixDrafter:
    """The model-free drafter `kind` (ngram | suffix), alone or as hybrid's first part."""
    if kind == "suffix":
        return SuffixDrafter(models.suffix.to_params(), device=models.device)
    return NgramDrafter(models.ngram_min, models.ngram_max, device=models.device)


def prompt_ids(tokenizer, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
    """Token ids of a chat prompt: the tokenizer's chat template (with the generation prompt) when it
    has one, else the plain encoding."""
    if messages is None:
        messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return tokenizer.encode("\n".join(m["content"] for m in messages))
