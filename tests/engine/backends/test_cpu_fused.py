"""The fused CPU ops (pipeline/engine/backends/cpu/fused.py, csrc/fused_ops.c): RMSNorm and silu(gate) * up
against transformers' own modules in fp32 and bf16, the module swap (which modules, what they
compute), the runner's cpu_fused switch, and the self-check catching a wrong kernel. The
engine's greedy identity with HF generate runs on them too (test_greedy_identity.py and the rest
use the default, auto)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from conftest import tiny_llama
from pipeline.engine.backends.cpu import fused as cpu_fused
from pipeline.engine.model.runner import build_runner

# Only a missing compiler skips: kernels that build but fail their self-check fail these tests.
pytestmark = pytest.mark.needs_cc

BF16_ULP = 2.0 ** -7          # one unit in the last place of a bf16 in [1, 2): relative spacing


def _norm_and_mlp(hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=gen)
    mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu",
                               num_attention_heads=1, num_key_value_heads=1))
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.weight.data = torch.randn(lin.weight.shape, generator=gen) / lin.in_features ** 0.5
    return norm.to(dtype), mlp.to(dtype)


@pytest.mark.parametrize("rows", [1, 5, 200])            # 200 x 576: over the kernels' threading threshold
@pytest.mark.parametrize("hidden,inter", [(576, 1536), (36, 100)])   # 36, 100: vector tails (fp32)
def test_fp32_equals_modules(rows, hidden, inter):
    norm, mlp = _norm_and_mlp(hidden, inter, torch.float32, seed=rows)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0)) * 3
    ops = cpu_fused.kernel()
    torch.testing.assert_close(cpu_fused.KernelRMSNorm(norm, ops)(x), norm(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cpu_fused.GateUpMLP(mlp, ops)(x), mlp(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 200])
def test_bf16_norm_rounds_where_torch_does(rows):
    """bf16 in, bf16 out, fp32 inside, rounded at torch's places: every element within one bf16
    rounding of the module's, and nearly all identical. Rounding once at the end instead (skipping the
    intermediate bf16 of the normalised x) moves ~1/4 of the elements by an ulp. (bf16 MLPs keep
    their modules: test_fuse_swaps_norms_and_mlps_and_keeps_logits.)"""
    norm, mlp = _norm_and_mlp(576, 1536, torch.bfloat16, seed=rows)
    x = (torch.randn(rows, 576, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    ops = cpu_fused.kernel()
    pairs = [(ops.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))]
    for got, want in pairs:
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=BF16_ULP, atol=1e-30)
        assert (got != want).float().mean().item() < 0.01


def test_silu_mul_extremes():
    """Large |gate| (the exponential's clamp), zeros and signs: silu(g) * u within fp32 rounding of
    torch's, absolutely, where torch's own values underflow."""
    g = torch.tensor([-200.0, -88.0, -20.0, -1e-3, -0.0, 0.0, 1e-3, 20.0, 88.0, 200.0] * 2)
    u = torch.linspace(-3, 3, g.numel())
    got = cpu_fused.kernel().silu_mul(torch.cat([g, u]).unsqueeze(0))[0]
    torch.testing.assert_close(got, nn.functional.silu(g) * u, rtol=1e-6, atol=1e-30 + 1e-35)


def test_bf16_silu_mul_rounds_where_torch_does():
    """bf16: silu(gate) rounded to bf16, then the product rounded: torch's silu then multiply on the
    same bf16 inputs, equal but for the rare element where our exponential and torch's fall on two
    sides of a rounding boundary (one bf16 step). Without the first rounding (one rounding of the
    exact product) ~15% of elements differ."""
    gen = torch.Generator().manual_seed(0)
    gu = (torch.randn(37, 2 * 1536, generator=gen) * 4).bfloat16()
    got = cpu_fused.kernel().silu_mul(gu)
    want = nn.functional.silu(gu[:, :1536]) * gu[:, 1536:]
    assert got.dtype == torch.bfloat16
    differ = got != want
    assert differ.float().mean().item() < 0.01
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)


def test_bad_shapes_are_refused():
    ops = cpu_fused.kernel()
    with pytest.raises(ValueError, match="both fp32 or both bf16"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match=r"2 \* inter\] fp32 or bf16"):
        ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match=r"2 \* inter\] fp32 or bf16"):
        ops.silu_mul(torch.randn(2, 8).half())
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.silu_mul(torch.randn(2, 12).bfloat16())
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.rms_norm(torch.randn(2, 12).bfloat16(), torch.ones(12).bfloat16(), 1e-6)


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.7, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_swaps_norms_and_mlps_and_keeps_logits(make, dtype):
    model = make(seed=4).to(dtype)
    plain = copy.deepcopy(model)
    layers = model.config.num_hidden_layers
    assert cpu_fused.fuse(model, cpu_fused.kernel()) == (2 * layers + 1, layers)
    left = [type(m).__name__ for m in model.modules() if type(m).__module__.startswith("transformers")
            and type(m).__name__.endswith(("RMSNorm", "MLP"))]
    assert left == []
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = model(ids).logits.float(), plain(ids).logits.float()
    tol = 1e-4 if dtype == torch.float32 else 5e-2 * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_fuse_keeps_mlps_when_told():
    """merge_mlps=False (the MLP form measured slower here): norms fused, every MLP the model's own."""
    model = tiny_llama(seed=4).bfloat16()
    layers = model.config.num_hidden_layers
    assert cpu_fused.fuse(model, cpu_fused.kernel(), merge_mlps=False) == (2 * layers + 1, 0)
    assert all(type(layer.mlp) is LlamaMLP for layer in model.model.layers)


def test_fuse_leaves_other_activations_alone():
    """An MLP whose activation is not SiLU (gelu) keeps its module: the kernel computes SiLU only."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, hidden_act="gelu")
    model = type(tiny_llama())(cfg).eval()
    assert cpu_fused.fuse(model, cpu_fused.kernel()) == (3, 0)
    assert type(model.model.layers[0].mlp) is LlamaMLP


def test_runner_modes():
    model = tiny_llama(seed=6)
    off = build_runner(copy.deepcopy(model), 2, 64, cpu_fused="off")
    assert (off.fused_norms, off.fused_mlps) == (0, 0) and off.cpu_fused is None
    auto = build_runner(copy.deepcopy(model), 2, 64)          # the MLP form as measured (test_calibrate.py)
    assert (auto.fused_norms, auto.fused_mlps) == (5, 2 if auto.mlp_plan.merged else 0)
    on = build_runner(copy.deepcopy(model), 2, 64, cpu_fused="on")
    assert (on.fused_norms, on.fused_mlps) == (5, 2) and on.mlp_plan is None
    with pytest.raises(RuntimeError, match="cpu_fused=on.*float16"):
        build_runner(copy.deepcopy(model).half(), 2, 64, cpu_fused="on")
    with pytest.raises(ValueError, match="cpu_fused: expected one of"):
        build_runner(copy.deepcopy(model), 2, 64, cpu_fused="yes")


class _SwappedHalves(cpu_fused.FusedOps):
    """A wrong kernel: silu(up) * gate."""

    def __init__(self, ops):
        self.__dict__.update(ops.__dict__)

    def silu_mul(self, gate_up):
        inter = gate_up.shape[-1] // 2
        return super().silu_mul(torch.cat([gate_up[..., inter:], gate_up[..., :inter]], -1))


def test_self_check_catches_a_wrong_kernel():
    assert cpu_fused.check_against_modules(cpu_fused.kernel()) < 1.0
    assert cpu_fused.check_against_modules(_SwappedHalves(cpu_fused.kernel())) > 1.0
