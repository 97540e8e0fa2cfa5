"""Load a target or draft model and its tokenizer from local files only.

Where a source's files are, and the on-disk cache, are pipeline/loading/files.py's business; this
module fills that cache: a GGUF is converted once into safetensors (exact dequantized float32
weights), because transformers' GGUF loader takes ~15 s where the cache loads in well under a second.

This module also refuses target/draft pairs whose vocabularies differ (what else the engine cannot run
it says itself: pipeline/engine/model/hf_config.py).

It knows nothing about the engine, KV caches, sampling, chat templates or Ray. transformers only ever
sees local folders (hub ids and object storage are made local by remote.py first), and nothing is
unpickled: `.bin` checkpoints are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .files import SHIPPED_MODELS, source_dir
from .remote import is_hub_id, is_url

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSpec:
    """Which model to load and how."""

    # registry name (see SHIPPED_MODELS), path to a .gguf file, or a HF model dir with *.safetensors
    source: str
    # weights/compute dtype after loading: one of DTYPES
    dtype: str = "bfloat16"
    # torch device string the model is moved to, e.g. "cpu" or "cuda:0"
    device: str = "cpu"
    # allow model/tokenizer code shipped inside the directory to run (off: only built-in architectures)
    trust_remote_code: bool = False
    # fsspec options for a source in object storage (endpoint, credentials); None: the environment's
    storage_options: dict | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r} "
                             "(resolve 'auto' first: pipeline.hardware.resolve_dtype)")


# ---------------------------------------------------------------------------------------------------
# GGUF -> safetensors cache


def load_gguf_direct(gguf_path: str | Path):
    """Model (dequantized, float32) and tokenizer straight from a GGUF: slow, used to fill the cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_path = Path(gguf_path).resolve()
    where = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name,
                 local_files_only=True)
    # dequantize=True: plain dense weights even where a packed-GGUF matmul kernel is installed
    model = AutoModelForCausalLM.from_pretrained(
        **where, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True))
    return model, AutoTokenizer.from_pretrained(**where)


def _strip_gguf_quantization(model) -> None:
    """Make a dequantized GGUF model a plain one, so save_pretrained accepts it."""
    model.hf_quantizer = None  # save_pretrained refuses GGUF: "quantized with gguf and is not serializable"
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def resolve_hf_dir(source: str, storage_options: dict | None = None) -> Path:
    """Local HF directory for any source: registry name, .gguf file (converted once into the cache,
    crash- and race-safe), HF directory, object-storage folder or hub id (copied once)."""
    return source_dir(source, _convert_gguf, storage_options)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a GGUF's model (dequantized, float32) and tokenizer into out_dir as safetensors."""
    model, tokenizer = load_gguf_direct(gguf_path)
    _strip_gguf_quantization(model)
    model.save_pretrained(out_dir)  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(out_dir)


# ---------------------------------------------------------------------------------------------------
# Loading


def load_model(spec: ModelSpec):
    """(model, tokenizer) for a spec: model in spec.dtype on spec.device, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_hf_dir(spec.source, spec.storage_options)
    common = dict(trust_remote_code=spec.trust_remote_code, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=DTYPES[spec.dtype], use_safetensors=True, **common)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **common)
    return model.to(spec.device).eval(), tokenizer


def model_id(spec: ModelSpec) -> str:
    """Readable id for records: the registry name, else the file or directory name."""
    if spec.source in SHIPPED_MODELS or is_hub_id(spec.source):
        return spec.source
    if is_url(spec.source):
        return spec.source.rstrip("/").rpartition("/")[2] or spec.source
    return Path(spec.source).expanduser().name or spec.source


# ---------------------------------------------------------------------------------------------------
# What the engine cannot run


def _vocab_mismatch(target_vocab: dict[str, int], draft_vocab: dict[str, int]) -> str | None:
    differing = sorted(t for t in target_vocab.keys() | draft_vocab.keys()
                       if target_vocab.get(t) != draft_vocab.get(t))
    if not differing:
        return None
    token = differing[0]
    return (f"tokenizer vocabularies differ in {len(differing)} entries (target "
            f"{len(target_vocab)}, draft {len(draft_vocab)} tokens); e.g. {token!r}: "
            f"target id {target_vocab.get(token)}, draft id {draft_vocab.get(token)}")


def check_vocab_compatible(target_model, draft_model, target_tok=None, draft_tok=None) -> None:
    """Raise ValueError unless target and draft share one token space (sizes and, if given, vocabs)."""
    target_size = target_model.config.vocab_size
    draft_size = draft_model.config.vocab_size
    if target_size != draft_size:
        raise ValueError(
            f"target and draft vocab sizes differ: target config.vocab_size={target_size}, "
            f"draft config.vocab_size={draft_size}; speculative decoding needs one token space"
        )
    if target_tok is not None and draft_tok is not None:
        problem = _vocab_mismatch(target_tok.get_vocab(), draft_tok.get_vocab())
        if problem:
            raise ValueError(problem)
