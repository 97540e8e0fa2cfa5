"""oneDNN-packed linears and planned linears (pipeline/engine/backends/cpu/linear.py): the same function as
nn.Linear, whichever kernel a call's row count is planned for; swapped in by the runner on CPU unless
disabled; copies and pickles; and the engine's greedy output through oneDNN, our panel kernel and a
plan mixing all three kernels equals plain Hugging Face decoding of the unpacked model. The panel
kernel itself: test_cpu_kernels.py; how plans are measured and chosen: test_calibrate.py."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from conftest import greedy_reference, make_engine, mixed_prompts, run_requests, tiny_llama
from pipeline.engine import SamplingParams
from pipeline.engine.backends.cpu.build import compiler
from pipeline.engine.backends.cpu.linear import (LinearPlan, PackedLinear, PlannedLinear, can_pack, pack_linears,
                                                 policy)
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


def test_linear_plan_segments():
    plan = LinearPlan(((4, "panel"), (16, "onednn"), (64, "onednn"), (128, "torch")))
    assert [plan.kind(m) for m in (1, 4, 5, 16, 17, 64, 65, 128, 5000)] == \
        ["panel", "panel", "onednn", "onednn", "onednn", "onednn", "torch", "torch", "torch"]
    assert plan.kinds == ("panel", "onednn", "torch")
    assert plan.describe() == "panel<=4 onednn<=64 torch"
    assert plan.last_rows("panel") == 4 and plan.last_rows("torch") > 10**9
    assert LinearPlan.single("onednn").describe() == "onednn"
    for bad in ((), ((4, "panel"), (4, "onednn")), ((8, "panel"), (4, "onednn")), ((4, "mkl"),)):
        with pytest.raises(ValueError, match="plan"):
            LinearPlan(bad)


@pytest.mark.needs_cc
@pytest.mark.parametrize("bias", [False, True])
def test_planned_linear_is_the_linear_at_every_row_count(bias):
    """Each row count runs its planned kernel (a wrong dispatch or layout shows as a wrong product); a
    copy and a pickle compute the same, the packed weight packed again on arrival."""
    torch.manual_seed(1)
    linear = nn.Linear(96, 160, bias=bias)
    planned = PlannedLinear(linear, LinearPlan(((2, "panel"), (8, "onednn"), (16, "torch"))),
                            policy("on", torch.device("cpu"), torch.float32))
    calls = []
    for name in ("_run_panels", "_run_packed", "_run_dense"):
        fn = getattr(planned, name)
        setattr(planned, name, lambda x, fn=fn, name=name: calls.append(name) or fn(x))
    planned._bind()
    for rows, kernel in ((1, "_run_panels"), (2, "_run_panels"), (3, "_run_packed"), (8, "_run_packed"),
                         (9, "_run_dense"), (40, "_run_dense")):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(planned(x), linear(x), rtol=1e-5, atol=1e-5)
        assert calls.pop() == kernel, rows
    x = torch.randn(2, 5, 96)                                            # 10 rows through a 3D input
    torch.testing.assert_close(planned(x), linear(x), rtol=1e-5, atol=1e-5)
    fresh = PlannedLinear(linear, planned.plan, policy("on", torch.device("cpu"), torch.float32))
    for other in (copy.deepcopy(fresh), pickle.loads(pickle.dumps(fresh))):
        for rows in (1, 5, 12):
            x = torch.randn(rows, 96)
            assert torch.equal(other(x), fresh(x))
    with pytest.raises(ValueError, match="panel kernel"):
        PlannedLinear(linear, LinearPlan.single("panel"), None)


def test_runner_packs_on_cpu_unless_disabled():
    assert build_runner(tiny_llama(), 2, 64, cpu_linear="off").packed_linears > 0
    off = build_runner(tiny_llama(), 2, 64, packed_linear=False)
    assert off.packed_linears == 0 and off.panel_linears == 0
    assert any(type(m) is nn.Linear for m in off.model.modules())


@pytest.mark.parametrize("linear", ["off", "on", "mixed"])
@pytest.mark.parametrize("kind", ["none", "draft-greedy"])
def test_engine_greedy_equals_unpacked_reference(target_model, draft_model, kind, linear):
    """The engine (oneDNN-packed, panel, or all three kernels by rows: decode and verify steps of 1-20
    tokens and prefills cross every boundary; the decoder loop over each) against HF generate on the
    fixture model, fp32."""
    if linear != "off" and compiler() is None:
        pytest.skip("no C compiler here: the panel kernel cannot be built")
    plan = LinearPlan(((2, "panel"), (8, "onednn"), (16, "torch"))) if linear == "mixed" else None
    engine = make_engine(target_model, kind, draft_model, max_num_seqs=4, cpu_linear="auto" if plan else linear,
                         linear_plan=plan)
    assert (engine.target.packed_linears if linear == "off" else engine.target.panel_linears) > 0
    assert engine.target.decoder is not None
    prompts = mixed_prompts(8, 512, seed=11)
    done, _ = run_requests(engine, prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, prompt, 12), f"prompt {i}"


@pytest.mark.amx_bf16
@pytest.mark.needs_cc
def test_planned_linear_takes_panels_and_amx_on_one_copy():
    """A plan of the panel kernel for few rows and the AMX kernel for more dispatches each, both over the
    one pair-panel copy of the weight; a copy and a pickle load their own kernels and compute the same."""
    from pipeline.engine.backends.cpu.linear import amx_kernel
    torch.manual_seed(2)
    linear = nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    plan = LinearPlan(((2, "panel"), (32, "amx"), (64, "onednn")))
    planned = PlannedLinear(linear, plan, policy("on", torch.device("cpu"), torch.bfloat16), amx_kernel())
    assert not hasattr(planned, "weight") and "packed_weight" in planned._buffers
    calls = []
    for name in ("_run_panels", "_run_amx", "_run_packed"):
        fn = getattr(planned, name)
        setattr(planned, name, lambda x, fn=fn, name=name: calls.append(name) or fn(x))
    planned._bind()
    for rows, kernel in ((1, "_run_panels"), (3, "_run_amx"), (17, "_run_amx"), (32, "_run_amx"), (40, "_run_packed")):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        want = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
        torch.testing.assert_close(planned(x).double(), want, rtol=2 ** -7, atol=1e-2)
        assert calls.pop() == kernel, rows
    fresh = PlannedLinear(linear, plan, policy("on", torch.device("cpu"), torch.bfloat16), amx_kernel())
    for other in (copy.deepcopy(fresh), pickle.loads(pickle.dumps(fresh))):
        x = torch.randn(20, 96).to(torch.bfloat16)
        assert torch.equal(other(x), fresh(x))
    with pytest.raises(ValueError, match="AMX kernel"):
        PlannedLinear(linear, plan, policy("on", torch.device("cpu"), torch.bfloat16), None)
