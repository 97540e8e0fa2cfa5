"""Our C kernels' build (pipeline/engine/backends/cpu/build.py) and the panel linear kernel
(pipeline/engine/backends/cpu/linear.py, csrc/panel_linear.c): against float64 F.linear over every tile
shape, through the runner against torch's linears, the engine's greedy output through it against
Hugging Face generate, and the cpu_linear switch. (The greedy-identity, KV-invariant and
chi-square tests run the engine on it too: it is the default on CPU fp32.)"""
import copy
import ctypes
import pickle
import subprocess

import pytest
import torch
from torch import nn

from conftest import mixed_prompts, tiny_llama
from pipeline.errors import ConfigError
from pipeline.job.config import load_config
from pipeline.engine.backends.cpu import attention as cpu_attention, build as cpu_kernels, isa, linear as cpu_linear
from pipeline.engine.model.plan import Kernels
from pipeline.engine.model.runner import build_runner

# Only a missing compiler skips: a kernel that builds but fails its self-check fails these tests.
pytestmark = pytest.mark.needs_cc


@pytest.mark.parametrize("source", [cpu_attention.SOURCE, cpu_linear.SOURCE], ids=lambda p: p.stem)
def test_build_is_cached_and_keyed(tmp_path, monkeypatch, source):
    monkeypatch.setenv("SPECPIPE_KERNEL_CACHE", str(tmp_path))
    first = cpu_kernels.build(source)
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build(source) == first and first.stat().st_mtime_ns == mtime    # reused, not rebuilt
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"some", "other", "cpu"}))
    assert cpu_kernels.build(source) != first                                          # another CPU: its own build
    assert len(list(tmp_path.glob(f"{source.stem}-*.so"))) == 2


def test_masked_flags_build_without_their_instructions(tmp_path, monkeypatch):
    """SPECPIPE_CPU_FLAGS_OFF: the kernels are built as for a CPU without the masked flags, in their own
    cache entry, and the library holds none of their instructions (no 512-bit registers with AVX-512
    masked, however many the host has). On a host without the masked flags the mask changes nothing:
    the same build."""
    if not isa.host_flags() & {"avx2", "avx512f"}:
        pytest.skip("needs an x86 CPU with AVX2 or AVX-512 (the flags masked here)")
    monkeypatch.setenv("SPECPIPE_KERNEL_CACHE", str(tmp_path))
    native = cpu_kernels.build(cpu_linear.SOURCE)
    monkeypatch.setenv(isa.MASK_ENV, "avx512*,amx*")
    assert not {f for f in isa.cpu_flags() if f.startswith(("avx512", "amx"))}
    assert ("-mno-avx512f" in isa.compiler_off()) == ("avx512f" in isa.host_flags())
    masked = cpu_kernels.build(cpu_linear.SOURCE)
    assert (masked != native) == any(f.startswith(("avx512", "amx")) for f in isa.host_flags())
    listing = subprocess.run(["objdump", "-d", str(masked)], capture_output=True, text=True, check=True).stdout
    assert "zmm" not in listing and "ymm" in listing                        # AVX2's registers, not AVX-512's


def test_header_edit_rebuilds(tmp_path, monkeypatch):
    """A source that includes a header beside it (csrc/vmath.h) gets a new build when the header
    changes, not the stale library of the old header."""
    monkeypatch.setenv("SPECPIPE_KERNEL_CACHE", str(tmp_path / "cache"))
    src_dir = tmp_path / "csrc"
    src_dir.mkdir()
    (src_dir / "k.h").write_text("static inline int answer(void) { return 1; }\n")
    source = src_dir / "k.c"
    source.write_text('#include "k.h"\nint get(void) { return answer(); }\n')
    first = cpu_kernels.build(source)
    (src_dir / "k.h").write_text("static inline int answer(void) { return 2; }\n")
    second = cpu_kernels.build(source)
    assert second != first and ctypes.CDLL(str(second)).get() == 2


def test_build_failure_names_the_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPIPE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false"):
        cpu_kernels.build(cpu_linear.SOURCE)
    assert list(tmp_path.iterdir()) == []                                              # no half-written file


def test_a_cpu_without_the_instructions_compiles_nothing_and_the_plan_names_it(monkeypatch, caplog):
    """The AMX and bf16 panel sources need flags (their #error): on a CPU without them nothing is
    compiled, nothing logged, and the plan line names each kernel left out with the missing flags."""
    from pipeline.engine.model.plan import cpu_lacks

    def no_build(*args, **kwargs):
        raise AssertionError("compiled a kernel the CPU cannot run")
    monkeypatch.setenv(isa.MASK_ENV, "avx512*,amx*")           # an AVX2-only CPU, whatever this one is
    monkeypatch.setattr(cpu_kernels, "build", no_build)
    with caplog.at_level("WARNING"):
        for source, needs in ((cpu_linear.SOURCE_AMX, cpu_linear.AMX_FLAVOUR.needs),
                              (cpu_attention.SOURCE_AMX, cpu_attention.AMX_FLAGS),
                              (cpu_linear.SOURCE_BF16, cpu_linear.FLAVOURS[torch.bfloat16].needs)):
            found, reason = cpu_kernels.load_checked(source, lambda p: p, lambda k: None, "x", needs=needs)
            assert found is None and reason.startswith(cpu_kernels.CPU_LACKS) and "avx512_bf16" in reason
    assert not caplog.records
    cpu = torch.device("cpu")
    assert cpu_lacks(cpu, torch.bfloat16) == ("panel-linear (no avx512f avx512_bf16), amx-linear (no amx_bf16 "
                                              "amx_tile avx512_bf16), amx-attention (no amx_bf16 amx_tile avx512_bf16)")
    assert cpu_lacks(cpu, torch.float32) == "" and cpu_lacks(torch.device("meta"), torch.bfloat16) == ""


def kernel(dtype=torch.float32) -> cpu_linear.PanelKernel:
    return cpu_linear.policy("on", torch.device("cpu"), dtype)


# The bf16 kernel needs the CPU's bf16 dot products (avx512f, avx512_bf16): only their absence skips its
# tests; where the CPU has them, a kernel that fails to build or its self-check fails them.


def test_panels_layout():
    """Panel p, row k holds W[16p .. 16p + 15, k]; outputs past N are zero."""
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    panels = cpu_linear.to_panels(w)
    assert panels.shape == (3, 3, 16)
    for n in range(48):
        for k in range(3):
            assert panels[n // 16, k, n % 16] == (w[n, k] if n < 40 else 0)


# rows: one (the stream), 2-5 (a partial tile), 6 (one tile), 7 and 97 (tiles + a remainder, more than
# one 96-row block); k: 1, odd, > one 512 chunk; n: < one panel, a panel and a partial panel.
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 97, 200])
@pytest.mark.parametrize("n,k", [(3, 1), (16, 37), (40, 513), (33, 1100)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_float64_linear(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = kernel()(x, cpu_linear.to_panels(w), b, n)
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    # terms of size ~1: fp32 rounding over k of them stays well under 1e-5 * sqrt(k); a dropped or
    # doubled term, a wrong panel or a missing bias is off by ~1
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * k ** 0.5)


def test_pair_panels_layout():
    """The bf16 kernel's layout: panel p, pair j, lane n holds (W[16p + n, 2j], W[16p + n, 2j + 1]);
    zeros past N and past an odd K."""
    w = torch.arange(20 * 5, dtype=torch.float32).view(20, 5) + 1
    panels = cpu_linear.to_pair_panels(w)
    assert panels.shape == (2, 3, 16, 2)
    for n in range(32):
        for k in range(6):
            assert panels[n // 16, k // 2, n % 16, k % 2] == (w[n, k] if n < 20 and k < 5 else 0)


@pytest.mark.avx512_bf16
@pytest.mark.parametrize("m", [1, 2, 11, 12, 13, 97, 200])
@pytest.mark.parametrize("n,k", [(3, 1), (16, 37), (40, 514), (33, 1101)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_kernel_equals_float64_linear(m, n, k, bias):
    """bf16 in and out: against float64 on the same bf16 values, within y's one rounding to bf16
    (2^-9 relative) plus fp32 accumulation; a dropped pair, a wrong panel, a swapped pair half or a
    missing bias is off by ~1. Rows: the stream, partial tiles, one 12-row tile, remainders, more
    than one 96-row block; k: 1, odd (the last pair half-empty), even."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    bf16 = kernel(torch.bfloat16)
    got = bf16(x, bf16.layout(w), b, n)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-5 * k ** 0.5)


@pytest.mark.amx_bf16
@pytest.mark.parametrize("m", [1, 15, 16, 17, 64, 65, 130])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 96), (33, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_kernel_equals_float64_linear(m, n, k, bias):
    """The AMX kernel over the bf16 pair panels: against float64 as the panel kernel is. Rows: one, a
    tile less one, a tile, a tile and one (the zero-padded tail), one 64-row block, past it, two blocks
    and a tail; n: whole and ragged panels; k: one A tile and many."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    amx = cpu_linear.amx_kernel()
    got = amx(x, amx.layout(w), b, n)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-5 * k ** 0.5)


def test_amx_is_offered_for_bf16_weights_with_inputs_a_multiple_of_32():
    bf16 = lambda n, k: torch.zeros(n, k, dtype=torch.bfloat16)
    cpu = torch.device("cpu")
    assert "bf16 weights" in cpu_linear.amx_unavailable(cpu, {"qkv": [torch.zeros(16, 64)]})
    assert "multiple of 32" in cpu_linear.amx_unavailable(cpu, {"qkv": [bf16(16, 64)], "down": [bf16(64, 40)]})
    assert "bf16 weights" in cpu_linear.amx_unavailable(torch.device("meta"), {"qkv": [bf16(16, 64)]})


@pytest.mark.amx_bf16
def test_amx_kernel_refuses_inputs_not_a_multiple_of_32():
    amx = cpu_linear.amx_kernel()
    w = torch.randn(16, 48).bfloat16()
    with pytest.raises(ValueError, match="status -2"):
        amx.unchecked(torch.randn(3, 48).bfloat16(), amx.layout(w), None, 16)


@pytest.mark.avx512_bf16
def test_bf16_panel_linear_and_runner():
    """PanelLinear in bf16 matches torch's bf16 nn.Linear (both round y once); a bf16 model's runner
    takes the bf16 panels, and its logits stay within bf16 noise of the model's own."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 160).bfloat16()
    panel = cpu_linear.PanelLinear(linear, kernel(torch.bfloat16))
    x = torch.randn(2, 7, 96).bfloat16()
    torch.testing.assert_close(panel(x), linear(x), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="bfloat16"):
        panel(torch.randn(2, 96))
    with pytest.raises(ValueError, match="float32 weight"):
        cpu_linear.PanelLinear(nn.Linear(8, 8), kernel(torch.bfloat16))
    model = tiny_llama(seed=3).bfloat16()
    plain = copy.deepcopy(model)
    runner = build_runner(model, 2, 64, cpu_linear="on")
    assert runner.panel_linears > 0 and runner.cpu_linear.dtype == torch.bfloat16
    ids = torch.tensor([mixed_prompts(1, 512, seed=5)[0] * 3])
    with torch.no_grad():
        got, want = model(ids).logits.float(), plain(ids).logits.float()
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    copy.deepcopy(model), pickle.loads(pickle.dumps(model))                     # copies and pickles


def test_kernel_rejects_a_mismatched_input():
    panels = cpu_linear.to_panels(torch.randn(20, 8))
    with pytest.raises(ValueError, match="does not fit"):
        kernel()(torch.randn(3, 9), panels, None, 20)
    with pytest.raises(ValueError, match="does not fit"):
        kernel()(torch.randn(3, 8, dtype=torch.float64), panels, None, 20)


@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    panel = cpu_linear.PanelLinear(linear, kernel())
    for shape in ((5, 96), (1, 7, 96), (2, 3, 96), (0, 96)):
        x = torch.randn(*shape)
        torch.testing.assert_close(panel(x), linear(x), rtol=1e-5, atol=1e-5)
    strided = torch.randn(4, 192)[:, ::2]                               # a non-contiguous input
    torch.testing.assert_close(panel(strided), linear(strided), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"\[\.\.\., 96\] float32"):
        panel(torch.randn(2, 95))


def test_a_model_with_panels_copies_and_pickles():
    model = tiny_llama(seed=4)
    cpu_linear.panel_linears(model, kernel())
    ids = torch.tensor([mixed_prompts(1, 512, seed=2)[0]])
    with torch.no_grad():
        want = model(ids).logits
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            torch.testing.assert_close(other(ids).logits, want, rtol=0, atol=0)


def test_runner_takes_panels_everywhere_where_told():
    model = tiny_llama(seed=3)
    plain = copy.deepcopy(model)
    runner = build_runner(model, 2, 64, cpu_linear="on", cpu_fused="on")
    num_linear = sum(type(m) is nn.Linear for m in plain.modules())      # gate + up: one linear (cpu_fused)
    assert runner.fused_mlps == 2
    assert runner.panel_linears == num_linear - runner.fused_mlps > 0 and runner.packed_linears == 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    ids = torch.tensor([mixed_prompts(1, 512, seed=5)[0] * 3])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    off = build_runner(tiny_llama(), 2, 64, cpu_linear="off")                  # oneDNN's packing instead
    assert off.panel_linears == 0 and off.cpu_linear is None


def test_modes():
    cpu = torch.device("cpu")
    assert cpu_linear.policy("off", cpu, torch.float32) is None
    assert cpu_linear.policy("auto", cpu, torch.float32) is not None
    assert cpu_linear.policy("auto", cpu, torch.float16) is None                    # oneDNN / torch then
    with pytest.raises(RuntimeError, match="float16"):
        cpu_linear.policy("on", cpu, torch.float16)
    missing = isa.lacks(cpu_linear.FLAVOURS[torch.bfloat16].needs)                # as this CPU (or its mask) is
    if not missing:
        assert cpu_linear.policy("auto", cpu, torch.bfloat16).dtype == torch.bfloat16
    else:
        assert cpu_linear.policy("auto", cpu, torch.bfloat16) is None
        with pytest.raises(RuntimeError, match=f"{cpu_kernels.CPU_LACKS} {', '.join(missing)}"):
            cpu_linear.policy("on", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="cpu_linear"):
        cpu_linear.policy("maybe", cpu, torch.float32)
    with pytest.raises(ValueError, match="packed_linear"):
        Kernels(cpu_linear="on", packed_linear=False)


@pytest.mark.parametrize("key", ["cpu_attention", "cpu_linear"])
def test_per_kernel_switches_are_not_config_keys(tmp_path, key):
    """The per-kernel switches are seams (Kernels), not job config: naming one fails, pointing at
    engine.kernels; engine.kernels itself takes auto | torch."""
    path = tmp_path / "job.yaml"
    path.write_text(f"engine:\n  {key}: off\n")
    with pytest.raises(ConfigError, match=rf"engine.{key} was replaced by engine.kernels"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=rf"engine.{key} was replaced by engine.kernels"):
        load_config(None, [f"engine.{key}=off"])
    assert load_config(None, ["engine.kernels=torch"]).engine.kernels == "torch"
    assert Kernels.of("torch") == Kernels(packed_linear=False, cpu_attention="off", cpu_linear="off",
                                          cpu_fused="off", cpu_decoder="off")
    with pytest.raises(ConfigError, match="engine.kernels"):
        load_config(None, ["engine.kernels=sometimes"])


