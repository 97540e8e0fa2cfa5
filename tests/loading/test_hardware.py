"""`models.dtype: auto`: every branch of the choice with injected hardware probes, the real probes on
this machine, the config default, and the resolved dtype reaching the loaded engine and the summary."""
import pytest
import torch

from pipeline.engine import DraftingConfig, EngineConfig
from pipeline.job.config import ModelsConfig
from pipeline.engine.backends.cpu.isa import MASK_ENV, cpu_flags, masked, proc_cpuinfo_flags
from pipeline.loading.hardware import DtypeChoice, resolve_dtype
from pipeline.report.summary import model_lines

AVX2 = {"avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_f", "avx512_bw", "avx512_vnni"}


def never_cuda(device):
    raise AssertionError("a CPU device must not probe CUDA")


def never_cpu():
    raise AssertionError("a CUDA device must not probe CPU flags")


@pytest.mark.parametrize("flags, dtype, reason", [
    (AVX2, "float32", "auto: CPU has no avx512_bf16/amx_bf16"),
    (AVX512, "float32", "auto: CPU has no avx512_bf16/amx_bf16"),        # plain AVX-512 emulates bf16
    (AVX512 | {"avx512_bf16"}, "bfloat16", "auto: avx512_bf16"),
    (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "bfloat16", "auto: amx_bf16"),
    ({"amx_bf16"}, "bfloat16", "auto: amx_bf16"),
    (set(), "float32", "auto: CPU has no avx512_bf16/amx_bf16"),           # no flags known (e.g. ARM)
])
def test_auto_on_cpu_follows_the_bf16_flags(flags, dtype, reason):
    assert resolve_dtype("auto", "cpu", flags=lambda: flags, cuda_bf16=never_cuda) == DtypeChoice(dtype, reason)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
@pytest.mark.parametrize("has_bf16, dtype", [(True, "bfloat16"), (False, "float16")])
def test_auto_on_cuda_follows_native_bf16(device, has_bf16, dtype):
    asked = []
    choice = resolve_dtype("auto", device, flags=never_cpu, cuda_bf16=lambda d: asked.append(d) or has_bf16)
    assert choice.dtype == dtype and asked == [device]     # the probe sees the configured device


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_explicit_dtypes_pass_through_without_probing(name, device):
    assert resolve_dtype(name, device, flags=never_cpu, cuda_bf16=never_cuda) == DtypeChoice(name, "configured")


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="'fp8'"):
        resolve_dtype("fp8", "cpu")


def test_proc_cpuinfo_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert proc_cpuinfo_flags(str(cpuinfo)) == {"fpu", "avx2", "avx512_bf16"}
    assert proc_cpuinfo_flags(str(tmp_path / "missing")) == frozenset()


def test_real_probes_agree_with_proc_cpuinfo(monkeypatch):
    """torch's cpuinfo (the reading off Linux) and /proc/cpuinfo name the same bf16 instructions on
    this machine, and `auto` follows them; masked, they are gone for every choice."""
    proc = proc_cpuinfo_flags()
    if not proc:
        pytest.skip("no /proc/cpuinfo flags line (not Linux)")
    monkeypatch.delenv(MASK_ENV, raising=False)
    bf16 = {"avx512_bf16", "amx_bf16"}
    torch_flags = {name for name, on in torch.cpu.get_capabilities().items() if on is True}
    assert cpu_flags() == proc and torch_flags & bf16 == proc & bf16
    assert resolve_dtype("auto", "cpu").dtype == ("bfloat16" if proc & bf16 else "float32")
    monkeypatch.setenv(MASK_ENV, " avx512*, amx_* ")
    assert not cpu_flags() & (bf16 | {"avx512f"}) and cpu_flags() | masked() == proc
    assert resolve_dtype("auto", "cpu") == DtypeChoice("float32", "auto: CPU has no avx512_bf16/amx_bf16")


def test_auto_is_the_config_default():
    assert ModelsConfig().dtype == "auto"


def test_build_engine_loads_in_the_resolved_dtype(tiny_model_dir):
    from pipeline.job.runtime import build_engine
    loaded = build_engine(ModelsConfig(target=str(tiny_model_dir)), DraftingConfig(method="ngram"),
                          EngineConfig(max_num_seqs=2, max_model_len=64))
    assert loaded.dtype == resolve_dtype("auto", "cpu")
    assert loaded.engine.target.dtype == getattr(torch, loaded.dtype.dtype)


def test_summary_names_each_dtype_choice():
    workers = [{"worker": "w0", "target": "m", "draft": None, "dtype": "float32", "dtype_reason": "auto: x"},
               {"worker": "w1", "target": "m", "draft": None, "dtype": "float32", "dtype_reason": "auto: x"},
               {"worker": "w2", "target": "m", "draft": "d", "dtype": "bfloat16", "dtype_reason": "auto: amx_bf16"}]
    assert model_lines(workers) == ["models: m, dtype float32 (auto: x) on w0, w1",
                                    "models: m + draft d, dtype bfloat16 (auto: amx_bf16) on w2"]


# ---- models.draft_dtype: the draft model's own dtype ----------------------------------------------
def test_draft_dtype_defaults_to_auto_and_hashes_only_when_it_matters():
    from pipeline.errors import ConfigError
    from pipeline.job.config import config_hash, hashed_tree, load_config
    assert ModelsConfig().draft_dtype == "auto"
    with pytest.raises(ConfigError, match=r"models\.draft_dtype.*'fp8'"):
        ModelsConfig(draft_dtype="fp8")
    draft = ["drafting.method=draft", "models.draft=x"]
    same = load_config("configs/demo.yaml", [*draft, "models.draft_dtype=same"])
    auto = load_config("configs/demo.yaml", draft)
    bf16 = load_config("configs/demo.yaml", [*draft, "models.draft_dtype=bfloat16"])
    assert "draft_dtype" not in hashed_tree(same)["models"]           # the target's dtype, hashed already
    assert hashed_tree(auto)["models"]["draft_dtype"] == "auto"
    assert hashed_tree(bf16)["models"]["draft_dtype"] == "bfloat16"     # other proposals: another run
    assert len({config_hash(same), config_hash(auto), config_hash(bf16)}) == 3
    ngram = load_config("configs/demo.yaml", ["models.draft_dtype=bfloat16"])   # no draft model: no effect
    assert config_hash(ngram) == config_hash(load_config("configs/demo.yaml"))


def test_resolve_draft_dtype():
    from pipeline.job.runtime import resolve_draft_dtype
    target = DtypeChoice("float32", "auto: CPU has no avx512_bf16/amx_bf16")
    assert resolve_draft_dtype(ModelsConfig(draft_dtype="same"), target) == DtypeChoice(
        "float32", "same as the target's: auto: CPU has no avx512_bf16/amx_bf16")
    assert resolve_draft_dtype(ModelsConfig(draft_dtype="bfloat16"), target) == DtypeChoice("bfloat16", "configured")
    assert resolve_draft_dtype(ModelsConfig(draft_dtype="auto"), target) == resolve_dtype("auto", "cpu")


def test_a_bf16_draft_beside_an_fp32_target_keeps_greedy_output(tiny_model_dir):
    """The draft loads in its own dtype, the target in its own, and greedy output stays the target's
    (the verifier never trusts the draft's precision); drafts are still accepted. Fixed-length drafting:
    the adaptive policy may find a draft as large as its target not worth running and draft nothing."""
    from conftest import run_requests
    from pipeline.engine import SamplingParams
    from pipeline.job.runtime import build_engine
    section = EngineConfig(max_num_seqs=3, max_model_len=96)
    spec = build_engine(ModelsConfig(target=str(tiny_model_dir), draft=str(tiny_model_dir),
                                     dtype="float32", draft_dtype="bfloat16"),
                        DraftingConfig(method="draft", adaptive=False), section)
    plain = build_engine(ModelsConfig(target=str(tiny_model_dir), dtype="float32"), DraftingConfig(method="none"),
                         section)
    assert spec.dtype == DtypeChoice("float32", "configured")
    assert spec.draft_dtype == DtypeChoice("bfloat16", "configured")
    assert spec.engine.target.dtype == torch.float32
    assert spec.engine.drafter.draft_runner.dtype == torch.bfloat16
    prompts = [list(range(40 + 7 * i, 60 + 9 * i)) for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    done, rounds = run_requests(spec.engine, prompts, params)
    ref, _ = run_requests(plain.engine, prompts, params)
    assert {k: c.output_ids for k, c in done.items()} == {k: c.output_ids for k, c in ref.items()}
    assert sum(r.accepted for r in rounds) > 0 and sum(r.draft_len - r.accepted for r in rounds) > 0


def test_summary_names_a_draft_in_another_dtype():
    workers = [{"worker": "w0", "target": "m", "draft": "d", "dtype": "float32", "dtype_reason": "configured",
                "draft_dtype": "bfloat16"},
               {"worker": "w1", "target": "m", "draft": "d", "dtype": "float32", "dtype_reason": "configured",
                "draft_dtype": "float32"}]
    assert model_lines(workers) == ["models: m + draft d (draft in bfloat16), dtype float32 (configured) on w0",
                                    "models: m + draft d, dtype float32 (configured) on w1"]
