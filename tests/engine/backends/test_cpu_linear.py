"""oneDNN-packed linears (pipeline/engine/backends/cpu/linear.py, where our panel kernel is off or cannot be
built): same function as nn.Linear, swapped in by the runner on CPU unless disabled, and the
engine's greedy output through them, and through our panel kernel, equals plain Hugging Face
decoding of the unpacked model. The panel kernel itself: test_cpu_kernels.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import greedy_reference, make_engine, mixed_prompts, run_requests, tiny_llama
from pipeline.engine import SamplingParams
from pipeline.engine.backends.cpu.build import compiler
from pipeline.engine.backends.cpu.linear import PackedLinear, can_pack, pack_linears
from pipeline.engine.model.runner import build_runner

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32),
                                reason="oneDNN not available in this torch build")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 40])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear)
    for shape in ((rows, 96), (1, rows, 96)):
        x = torch.randn(*shape)
        expected = linear(x)
        got = packed(x)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_pack_linears_swaps_every_linear_and_keeps_logits():
    model = tiny_llama(seed=3)
    plain = copy.deepcopy(model)
    num_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == num_linear > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    ids = torch.tensor([mixed_prompts(1, 512, seed=5)[0] * 3])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


def test_runner_packs_on_cpu_unless_disabled():
    assert build_runner(tiny_llama(), 2, 64, cpu_linear="off").packed_linears > 0
    off = build_runner(tiny_llama(), 2, 64, packed_linear=False)
    assert off.packed_linears == 0 and off.panel_linears == 0
    assert any(type(m) is nn.Linear for m in off.model.modules())


@pytest.mark.parametrize("linear", ["off", "on"])
@pytest.mark.parametrize("kind", ["none", "draft-greedy"])
def test_engine_greedy_equals_unpacked_reference(target_model, draft_model, kind, linear):
    """The engine (oneDNN-packed or panel linears, its own copy) against HF generate on the fixture model."""
    if linear == "on" and compiler() is None:
        pytest.skip("no C compiler here: the panel kernel cannot be built")
    engine = make_engine(target_model, kind, draft_model, max_num_seqs=4, cpu_linear=linear)
    assert (engine.target.packed_linears if linear == "off" else engine.target.panel_linears) > 0
    prompts = mixed_prompts(8, 512, seed=11)
    done, _ = run_requests(engine, prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, prompt, 12), f"prompt {i}"
