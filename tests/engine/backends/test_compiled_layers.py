"""Decoder layers compiled by inductor (backends/compiled.py), on CPU through the graph path without capture
(what a CUDA graph replays) with attention by lengths: the same logits as the modules (fp32, atol 1e-4:
inductor may reorder RMSNorm's sum), greedy output as Hugging Face `generate`'s up to near ties, far
fewer ops per forward (the elementwise work fused), and a compiler failure falls back to the modules.

Ops per forward are counted by torch's profiler: aten ops that compute (views and allocations left
out); a fused inductor kernel is no aten op. On a GPU each such op is a kernel launch; bench/gpu_check.sh
counts the real kernels per step.
"""
import collections
import copy

import pytest
import torch
from torch.profiler import profile

from conftest import greedy_reference, make_engine, mixed_prompts, near_tie_mismatches, run_requests, tiny_llama
from pipeline.engine import SamplingParams
from pipeline.engine.backends import compiled
from pipeline.engine.backends.cuda.graphs import UNCAPTURED
from pipeline.engine.model.plan import Kernels
from pipeline.engine.model.runner import build_runner

NOT_COMPUTE = {"as_strided", "view", "reshape", "transpose", "unsqueeze", "slice", "select", "t", "resolve_conj",
               "expand", "alias", "detach", "_unsafe_view", "squeeze", "permute", "contiguous", "lift_fresh",
               "empty", "empty_strided", "split", "_reshape_alias", "unbind", "narrow", "resize_"}


@pytest.fixture(scope="module")
def model():
    return tiny_llama()          # the engine tests' target_model: its compiled layers are cached for them


def runner(model, layers: str):
    return build_runner(copy.deepcopy(model), 4, 128, packed_linear=False, cpu_attention="off", cpu_fused="off",
                        cuda_graphs=UNCAPTURED, compile="on", compiled_layers=layers)


def ops_per_forward(r, *args) -> int:
    with profile() as prof:
        r.forward(*args)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.name[6:] not in NOT_COMPUTE)


@pytest.mark.slow
def test_same_logits_fewer_ops(model):
    eager, comp = runner(model, "off"), runner(model, "on")
    assert comp.compiled_layers == 2 and comp.plan.layers == "compiled" and eager.plan.layers == "modules"
    gen = torch.Generator().manual_seed(0)
    slots = [0, 1, 2]
    history = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (30, 12, 50)]
    for r in (eager, comp):
        r.forward(slots, [0] * 3, history, logits="none")
    starts = [len(h) for h in history]
    for step in range(4):                       # verify-like steps of 1-4 tokens, rows of unequal length
        new = [torch.randint(0, 512, (1 + (step + b) % 4,), generator=gen).tolist() for b in range(3)]
        want, got = eager.forward(slots, starts, new), comp.forward(slots, starts, new)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        starts = [s + len(n) for s, n in zip(starts, new)]
    args = (slots, starts, [[1, 2], [3], [4, 5, 6]])
    counts = [ops_per_forward(r, *args) for r in (eager, comp)]
    assert counts[1] < 0.6 * counts[0], counts   # 88 -> 9 ops per layer, 97 outside the layers


@pytest.mark.slow
def test_greedy_identity_with_compiled_layers():
    """On a 1-layer model: inductor compiles each decoder layer apart (its layer index is a guard), and
    the 2-layer compile is test_same_logits_fewer_ops's."""
    model = tiny_llama(layers=1, seed=2)
    prompts = mixed_prompts(8, model.config.vocab_size, seed=6)
    engine = make_engine(model, "ngram", None, max_num_seqs=3, max_model_len=128, g=4, compile="on",
                         cpu_attention="off", cuda_graphs=UNCAPTURED,
                         target_switches=dict(packed_linear=False, cpu_fused="off", compiled_layers="on"))
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=24, temperature=0), arrive_every=2)
    outputs = [done[str(i)].output_ids for i in range(len(prompts))]
    references = [greedy_reference(model, p, 24) for p in prompts]
    assert near_tie_mismatches(model, prompts, outputs, references) <= 1
    assert engine.target.compiled_layers == len(compiled.decoder_layers(model)) and sum(r.accepted for r in rounds) > 0


@pytest.mark.slow
def test_a_compiler_failure_falls_back_to_the_modules(model):
    eager, comp = runner(model, "off"), runner(model, "on")

    def failing(gm, example_inputs):
        raise RuntimeError("no kernel for this op")
    torch._dynamo.reset()               # layers compiled by earlier tests would be found in dynamo's cache
    for layer in compiled.decoder_layers(comp.model):
        layer.compile(backend=failing, dynamic=True)
    prompt = [[5, 6, 7, 8, 9]]
    want = eager.forward([0], [0], prompt)
    with pytest.warns(RuntimeWarning, match="(?s)compiled layers off for this model: .*no kernel for this op"):
        got = comp.forward([0], [0], prompt)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert comp.compiled_layers == 0 and comp.plan.layers == "modules"
    assert "no kernel for this op" in comp.layers_off_reason
    torch.testing.assert_close(comp.forward([0], [5], [[10]]), eager.forward([0], [5], [[10]]))


def test_policy(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compiled.policy("auto", "auto", cpu) is False and compiled.policy("off", "on", cpu) is False
    assert compiled.policy("on", "off", cpu) is True
    monkeypatch.setattr(compiled, "flex_unavailable", lambda device: None)
    assert compiled.policy("auto", "auto", cuda) is True and compiled.policy("auto", "off", cuda) is False
    monkeypatch.setattr(compiled, "flex_unavailable", lambda device: "triton is not installed")
    assert compiled.policy("auto", "auto", cuda) is False
    with pytest.raises(RuntimeError, match="triton is not installed"):
        compiled.policy("on", "auto", cuda)
    with pytest.raises(ValueError, match="compiled_layers"):
        Kernels(compiled_layers="yes")
    assert collections.Counter(type(m).__name__ for m in compiled.decoder_layers(tiny_llama(layers=2))) == {
        "LlamaDecoderLayer": 2}
