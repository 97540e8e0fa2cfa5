"""Load one tensor-parallel rank's part of a model: only its slices are read from the safetensors.

The model is made on the meta device (no memory), each parameter then filled from the checkpoint
with `safe_open(...).get_slice(name)[...]` over the rows or columns engine/parallel/shard.py's Split
gives this rank, so a rank's peak memory is its part of the split weights plus what every rank keeps
whole (embeddings, norms), never the whole model. A tied LM head reads its vocabulary part from the
embedding. Sources are those load_model takes (shipped packages, GGUF converted once into the cache,
folders, s3://, hub ids); the files are on the node once, shared by its ranks.

Knows nothing about groups, runners or Ray.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..engine.model.hf_config import text_config
from ..engine.parallel.shard import Split, localize_model, set_parameter
from .models import DTYPES, ModelSpec, resolve_hf_dir


def load_model_shard(spec: ModelSpec, size: int, rank: int, tokenizer: bool = True):
    """(model, tokenizer, split): rank `rank` of `size`'s part of the model, in spec.dtype on spec.device,
    in eval mode (tokenizer False: None in its place, as the ranks that only run forwards need).
    ValueError (naming models.tensor_parallel_size) where the model cannot be split so."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model_dir = resolve_hf_dir(spec.source, spec.storage_options)
    common = dict(trust_remote_code=spec.trust_remote_code, local_files_only=True)
    config = AutoConfig.from_pretrained(model_dir, **common)
    split = Split.of(text_config(config), size, rank)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[spec.dtype],
                                                 trust_remote_code=spec.trust_remote_code)
    _fill(model, model_dir, split, DTYPES[spec.dtype], spec.device)
    _rebuild_buffers(model, spec.device)
    localize_model(model, split)
    if (model_dir / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(model_dir, **common)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir, **common) if tokenizer else None, split


def _fill(model: nn.Module, model_dir: Path, split: Split, dtype: torch.dtype, device: str) -> None:
    """Every parameter of `model` from the checkpoint's slices this rank holds."""
    from safetensors import safe_open
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(params)
    files = sorted(model_dir.glob("*.safetensors"))
    embed = next((n for n in params if n.endswith("embed_tokens.weight")), None)
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = set(f.keys())
            for name in sorted(names & missing):
                _assign(model, name, _read(f, name, split, name), split, dtype, device)
                missing.discard(name)
            head = "lm_head.weight"
            if head in missing and embed in names and getattr(model.config, "tie_word_embeddings", False):
                if split.size == 1:              # one rank: the head is the embedding itself, held once
                    model.get_output_embeddings().weight = model.get_input_embeddings().weight
                else:
                    _assign(model, head, _read(f, embed, split, head), split, dtype, device)
                missing.discard(head)
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint has no tensor for {sorted(missing)[:5]} "
                         f"({len(missing)} parameters of the model)")


def _read(f, stored: str, split: Split, name: str) -> torch.Tensor:
    """The part of checkpoint tensor `stored` that parameter `name` holds on this rank."""
    part = split.slice_of(name)
    if part is None:
        return f.get_tensor(stored)
    axis, start, stop = part
    view = f.get_slice(stored)
    return view[start:stop] if axis == 0 else view[:, start:stop]


def _assign(model: nn.Module, name: str, data: torch.Tensor, split: Split, dtype, device) -> None:
    if split.zeroes(name):
        data = torch.zeros_like(data)
    set_parameter(model, name, data.to(device=device, dtype=dtype))


def _rebuild_buffers(model: nn.Module, device: str) -> None:
    """Modules whose buffers are computed at construction (RoPE's inverse frequencies), made again on
    `device`: the meta model has none of their values."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        cfg = getattr(module, "config", None)
        if cfg is None:
            raise ValueError(f"cannot rebuild {name} ({type(module).__name__}) off the meta device")
        with torch.device(device):
            fresh = type(module)(cfg)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, fresh)
