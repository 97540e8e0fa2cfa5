"""The forward as one loop over our CPU kernels (pipeline/engine/backends/cpu/decoder.py, the cpu_decoder switch):
bitwise the logits and the slot store of the same runner on the model's own modules, for each family
it takes (Llama, Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms, Mistral), fp32 and bf16,
over ragged rows, non-contiguous slots, prefill chunks, verify steps and rollbacks, and over each
linear plan (panel kernel, oneDNN, F.linear, and all three by rows in one step sequence); q/k/v
merged into one linear or not; which models and settings it refuses, and why; the self-check
catching a wrong RoPE. The engine's greedy identity with HF generate runs on it too (test_greedy_identity.py "cpu",
test_kv_invariants.py, and every test on the default, auto)."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from pipeline.engine.backends.cpu import decoder as cpu_decoder, fused as cpu_fused
from pipeline.engine.backends.cpu.linear import LinearPlan
from pipeline.engine.model.runner import build_runner

pytestmark = pytest.mark.needs_cc

COMMON = dict(vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5, tie_word_embeddings=False)
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),                           # q/k/v biases
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32)),              # q/k norms, wide heads
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
}


def _model(family: str, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    model = FAMILIES[family]().eval()
    with torch.no_grad():           # random biases and norm weights, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn(p.shape) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model.to(dtype)


# Linear plans the loop runs over. The steps below forward 50, 18, 4, 3 and 8 tokens: the mixed plan
# takes each kernel in some step (3, 4: panel; 8: oneDNN; 18, 50: F.linear).
PANELS = LinearPlan.single("panel")
PLANS = {"panel": PANELS, "onednn": LinearPlan.single("onednn"), "torch": LinearPlan.single("torch"),
         "mixed": LinearPlan(((4, "panel"), (8, "onednn"), (16, "torch")))}


def _pair(model, slots: int = 5, max_len: int = 200, plan: LinearPlan = PANELS):
    loop = build_runner(copy.deepcopy(model), slots, max_len, cpu_decoder="on", linear_plan=plan)
    modules = build_runner(copy.deepcopy(model), slots, max_len, cpu_decoder="off", linear_plan=plan)
    assert loop.decoder is not None and modules.decoder is None
    return loop, modules


# (slots, starts, tokens per row, logits): prefill chunks of three prompts in non-contiguous slots, the
# third prompt's second chunk beside two verify rows, a rollback (row 0 restarts 2 positions back over
# rejected drafts), decode rows; "none" is the engine's prefill, "last" a plain step's logits
STEPS = [([4, 0, 2], [0, 0, 0], [7, 3, 40], "none"),
         ([2, 4, 0], [40, 7, 3], [9, 4, 5], "all"),
         ([4, 0], [9, 8], [1, 3], "last"),
         ([2, 0, 4], [49, 9, 10], [1, 1, 1], "last"),
         ([0, 2, 4], [10, 50, 11], [1, 2, 5], "all")]


def _run(runner, steps, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for slots, starts, lengths, logits in steps:
        tokens = [torch.randint(0, COMMON["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
        outs.append(runner.forward(slots, starts, tokens, logits))
    return outs


def _assert_same(loop, modules, steps=STEPS):
    for got, want in zip(_run(loop, steps), _run(modules, steps)):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.shape == want.shape and torch.equal(got, want), (got - want).abs().max()
    for name in ("keys", "values"):
        for layer, (a, b) in enumerate(zip(getattr(loop.cache, name), getattr(modules.cache, name))):
            assert torch.equal(a, b), f"{name} of layer {layer} differ"
    assert loop.num_forward_tokens == modules.num_forward_tokens


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.avx512_bf16)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loop_is_bitwise_the_modules(family, dtype, plan):
    loop, modules = _pair(_model(family, dtype), plan=PLANS[plan])
    assert loop.decoder.merged == COMMON["num_hidden_layers"] * ("panel" in PLANS[plan].kinds)   # q/k/v as one
    assert loop.plan.linear == f"planned: {PLANS[plan].describe()}"
    _assert_same(loop, modules)


@pytest.mark.amx_bf16
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loop_over_the_amx_kernel_is_bitwise_the_modules(family):
    """bf16 with the AMX kernel in the plan (the steps' 4 and 5 tokens) beside the panel kernel (1-3) and
    oneDNN (8+): the loop and the modules over the same planned linears compute the same."""
    plan = LinearPlan(((3, "panel"), (5, "amx"), (18, "onednn")))
    loop, modules = _pair(_model(family, torch.bfloat16), plan=plan)
    assert loop.amx is not None and loop.plan.linear == f"planned: {plan.describe()}"
    _assert_same(loop, modules)


def test_loop_matches_hf_forward_within_rounding():
    """Against Hugging Face's own forward (torch's linears, no slot store): a prompt in chunks."""
    model = _model("qwen3", torch.float32)
    loop = build_runner(copy.deepcopy(model), 3, 128, cpu_decoder="on")
    ids = torch.randint(0, COMMON["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(2))
    first = loop.forward([1], [0], [ids[0, :18].tolist()], "all")
    rest = loop.forward([1], [18], [ids[0, 18:].tolist()], "all")
    with torch.inference_mode():
        want = model(ids).logits[0]
    torch.testing.assert_close(torch.cat([first, rest]), want, rtol=1e-4, atol=1e-4)


def test_unmerged_projections_take_three_calls():
    """Widths that are not multiples of the panel (40, 8): q, k and v stay three linears; same numbers."""
    cfg = dict(COMMON, hidden_size=40, num_attention_heads=5, num_key_value_heads=1, intermediate_size=72)
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).eval()
    loop, modules = _pair(model)
    assert loop.decoder.merged == 0
    _assert_same(loop, modules)


def test_modules_on_the_merged_panels_compute_the_same():
    """The merge leaves q/k/v_proj holding views of one buffer: the model's own forward through them
    (the runner with its loop taken away) gives what the loop gives."""
    loop = build_runner(_model("llama", torch.float32), 5, 200, cpu_decoder="on", linear_plan=PANELS)
    attn = loop.model.model.layers[1].self_attn
    merged = loop.decoder.layers[1].qkv.panels
    assert attn.k_proj.panels.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    with_loop = _run(loop, STEPS[:2])
    keys = [k.clone() for k in loop.cache.keys]
    loop.decoder = None
    for t in (*loop.cache.keys, *loop.cache.values):
        t.zero_()
    without = _run(loop, STEPS[:2])
    assert torch.equal(with_loop[1], without[1])
    assert all(torch.equal(a, b) for a, b in zip(keys, loop.cache.keys))


def test_modes_and_refusals():
    model = _model("llama", torch.float32)
    # auto: not where a kernel it runs on is off
    assert build_runner(copy.deepcopy(model), 2, 64, cpu_attention="off").decoder is None
    assert build_runner(copy.deepcopy(model), 2, 64, cpu_fused="off").decoder is None
    assert build_runner(copy.deepcopy(model), 2, 64, packed_linear=False).decoder is None
    with pytest.raises(RuntimeError, match="cpu_decoder=on.*cpu_attention is not in use"):
        build_runner(copy.deepcopy(model), 2, 64, cpu_attention="off", cpu_decoder="on")
    with pytest.raises(ValueError, match="cpu_decoder: expected one of"):
        build_runner(copy.deepcopy(model), 2, 64, cpu_decoder="yes")
    # a model class it does not know, even a subclass of one it does
    sub = type("MyLlama", (LlamaForCausalLM,), {})(model.config).eval()
    with pytest.raises(RuntimeError, match="MyLlama: the loop knows"):
        build_runner(sub, 2, 64, cpu_decoder="on")
    # a sliding window shorter than the context served: the kernels attend to every key
    torch.manual_seed(0)
    windowed = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=32)).eval()
    with pytest.raises(RuntimeError, match="MistralForCausalLM's attention has sliding window 32 on 3 of 3 layers"):
        build_runner(copy.deepcopy(windowed), 2, 64, cpu_decoder="on")
    assert build_runner(windowed, 2, 32, cpu_decoder="on").decoder is not None


def test_rope_store_refuses_positions_outside_the_store():
    ops = cpu_fused.kernel()
    q, k = torch.zeros(2, 64), torch.zeros(2, 32)
    cos = sin = torch.zeros(2, 16)
    store = torch.zeros(3, 2, 10, 16)
    ok = torch.tensor([[1], [8], [2], [0]])
    assert ops.rope_store(q, k, k.clone(), cos, sin, ok, store, store.clone()).shape == (2, 4, 16)
    for bad in ([[1], [9], [2], [0]], [[3], [0], [2], [0]]):      # past the capacity; no such slot
        with pytest.raises(ValueError, match="outside the store"):
            ops.rope_store(q, k, k.clone(), cos, sin, torch.tensor(bad), store, store.clone())


class _SwappedSinCos(cpu_fused.FusedOps):
    """A wrong kernel: RoPE with sin and cos exchanged."""

    def __init__(self, ops):
        self.__dict__.update(ops.__dict__)

    def rope_store(self, q, k, v, cos, sin, *rest):
        return super().rope_store(q, k, v, sin, cos, *rest)


def test_self_check_catches_a_wrong_rope():
    assert cpu_fused.check_against_modules(cpu_fused.kernel()) < 1.0
    assert cpu_fused.check_against_modules(_SwappedSinCos(cpu_fused.kernel())) > 1.0


def test_unsupported_names_the_missing_kernels():
    model = _model("llama", torch.float32)
    why = cpu_decoder.unsupported(model, None, None)
    assert "cpu_attention, cpu_fused is not in use" in why


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.avx512_bf16)])
def test_loop_over_row_attention_is_bitwise_the_modules(tmp_path, monkeypatch, dtype):
    """Where prompt rows of >= 16 new tokens take torch's SDPA (the plan's RowAttention, here set by
    recorded timings): the loop and the modules still compute the same; the steps' 40-token chunk
    goes through SDPA."""
    from pipeline.engine.backends.cpu import attention as cpu_attention, calibrate
    monkeypatch.setenv("SPECPIPE_KERNEL_CACHE", str(tmp_path))
    timings = {16: {"kernel": 2.0, "sdpa": 1.0}, 64: {"kernel": 4.0, "sdpa": 1.0}}
    monkeypatch.setattr(calibrate, "measure_attention", lambda *a, **k: timings)
    loop, modules = _pair(_model("llama", dtype))
    assert isinstance(loop.cpu_attention, cpu_attention.RowAttention) and loop.cpu_attention.long_from == 16
    _assert_same(loop, modules)


@pytest.mark.amx_bf16
def test_loop_over_amx_attention_is_bitwise_the_modules(tmp_path, monkeypatch):
    """Where rows of >= 4 new tokens take our AMX attention kernel (recorded timings; head size 32): the
    loop and the modules compute the same, prompt chunks and verify rows through it."""
    from pipeline.engine.backends.cpu import attention as cpu_attention, calibrate
    monkeypatch.setenv("SPECPIPE_KERNEL_CACHE", str(tmp_path))
    timings = {4: {"kernel": 2.0, "sdpa": 3.0, "amx": 1.0}, 64: {"kernel": 4.0, "sdpa": 2.0, "amx": 1.0}}
    monkeypatch.setattr(calibrate, "measure_attention", lambda *a, **k: timings)
    loop, modules = _pair(_model("qwen3", torch.bfloat16))
    assert loop.cpu_attention.long_kind == "amx" and loop.cpu_attention.long_from == 4
    _assert_same(loop, modules)


@pytest.mark.parametrize("plan", ["panel", "onednn", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.avx512_bf16)])
def test_loop_over_the_family_mlp_is_bitwise_the_modules(tmp_path, monkeypatch, dtype, plan):
    """Where the MLP plan keeps the family's own MLP (recorded timings: the modules faster), the loop makes
    its calls itself, gate and up in one panel call where both take panels, and computes what the module
    computes; the mixed plan's steps take the merged call (3, 4 rows) and the separate ones (8+)."""
    from pipeline.engine.backends.cpu import calibrate
    monkeypatch.setenv("SPECPIPE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "measure_mlp", lambda *a, **k: {8: {"modules": 1.0, "merged": 2.0}})
    loop, modules = _pair(_model("llama", dtype), plan=PLANS[plan])
    assert loop.mlp_plan is not None and not loop.mlp_plan.merged
    gated = [layer.gated for layer in loop.decoder.layers]
    assert all(g is not None for g in gated)
    assert all((g.gate_up is not None) == ("panel" in PLANS[plan].kinds) for g in gated)
    _assert_same(loop, modules)
