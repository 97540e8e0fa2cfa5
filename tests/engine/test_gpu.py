"""The same engine on CUDA, unchanged (device from config). Skipped where no CUDA device exists; run
on a GPU machine by `bash bench/gpu_check.sh`.

- fp32 greedy identity: every drafter, eager (compile off) and compiled FlexAttention (compile on),
  with steps replayed as CUDA graphs and without (cuda_graphs.py; with them, every runner must have
  captured graphs and kept them: none switched off by the capture's self-check), against Hugging
  Face `generate` on the same CUDA device. A difference is allowed only where the target's top-2
  logits (CPU copy, fp64 head) are within NEAR_TIE (conftest), and at most MAX_TIES prompts.
- Sampling (temperature 0.8): valid tokens, and the same seeds give the same tokens on a rerun.
- Steps run ahead (engine.run_ahead): the tokens of steps that wait, seed for seed.
- bf16: completes, and agrees with fp32 on the first tokens of most prompts (threshold below).
- A real checkpoint, only when SPECPIPE_GPU_MODEL_DIR names a safetensors directory (skipped else).

The tiny models are random-init (only the weights are fake); they need no files.
"""
import collections
import copy
import os

import pytest
import torch

from conftest import (DRAFTERS, greedy_reference, greedy_references_fixture, make_engine, mixed_prompts,
                      mixed_prompts_fixture, near_tie_mismatches, run_requests)
from pipeline.engine import SamplingParams, TreeParams

pytestmark = pytest.mark.gpu

NUM_PROMPTS, MAX_NEW = 24, 24
MAX_TIES = 2             # prompts (of NUM_PROMPTS) allowed to differ, each on a checked near-tie
BF16_PREFIX, BF16_MIN_AGREE = 2, 0.75
MODEL_DIR_ENV = "SPECPIPE_GPU_MODEL_DIR"


@pytest.fixture(scope="module", autouse=True)
def ieee_fp32_matmul():
    """fp32 matmuls in full precision (no TF32), also inside the compiled FlexAttention kernel."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.fixture(scope="module")
def cuda_target(target_model):
    return copy.deepcopy(target_model).cuda()


@pytest.fixture(scope="module")
def cuda_draft(draft_model):
    return copy.deepcopy(draft_model).cuda()


prompts = mixed_prompts_fixture(NUM_PROMPTS, seed=2)
cuda_references = greedy_references_fixture(MAX_NEW, model="cuda_target")


def assert_on_cuda(engine, compile: str, graphs: bool) -> None:
    """Every runner keeps its KV on the device, takes FlexAttention on every step exactly when compile is
    on (eager padded SDPA when off), and replays CUDA graphs exactly when they are on."""
    runners = [engine.target] + ([engine.drafter.draft_runner] if engine.drafter.draft_runner else [])
    for runner in runners:
        assert runner.cache.keys[0].is_cuda and runner.cache.values[-1].is_cuda
        assert runner.flex == {"on": "always", "off": None}[compile]
        if compile == "on":            # each decoder layer compiled, and kept
            assert runner.compiled_layers > 0, f"layers not compiled: {runner.layers_off_reason}"
        if graphs:
            g = runner.graphs
            assert g is not None and g.capture is not None, "CUDA graphs were not set up"
            assert g.enabled, f"CUDA graphs switched off: {g.disabled_reason}"
            assert g.num_graphs > 0 and g.num_replays > 0
            if runner is engine.target:     # its verify steps: forward and verification in one graph
                assert g.tails_enabled, f"verification inside the graph switched off: {g.tails_disabled_reason}"
                assert g.num_tails > 0
                # steps without drafts run ahead (engine.run_ahead auto)
                assert engine.run_ahead and (engine.num_steps_ahead > 0) == (engine.drafter.kind == "none")
        else:
            assert runner.graphs is None


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("compile,graphs", [("off", "off"), ("off", "on"), ("on", "on")])
def test_greedy_identity_on_cuda(kind, compile, graphs, target_model, cuda_target, cuda_draft, prompts,
                                 cuda_references):
    engine = make_engine(cuda_target, kind, cuda_draft, max_num_seqs=8, max_model_len=128, g=4, compile=compile,
                         cuda_graphs=graphs)
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0), arrive_every=2)
    outputs = [done[str(i)].output_ids for i in range(NUM_PROMPTS)]
    mismatches = near_tie_mismatches(target_model, prompts, outputs, cuda_references)
    assert mismatches <= MAX_TIES, f"{mismatches} near-tie mismatches out of {NUM_PROMPTS}"
    if kind != "none":     # the drafts must have been exercised, or identity is trivial
        assert sum(r.accepted for r in rounds) > 0
    assert_on_cuda(engine, compile, graphs=graphs == "on")


@pytest.mark.parametrize("kind", ["suffix", "ngram"])
@pytest.mark.parametrize("compile,graphs", [("off", "off"), ("off", "on"), ("on", "off")])
def test_tree_greedy_identity_on_cuda(kind, compile, graphs, target_model, cuda_target, prompts, cuda_references):
    """Token trees (16 tokens, 3 branches) through padded SDPA, the captured graphs' tree buckets and
    FlexAttention's tree mask on the device."""
    engine = make_engine(cuda_target, kind, None, max_num_seqs=8, max_model_len=128, g=4, compile=compile,
                         cuda_graphs=graphs, tree=TreeParams(max_tokens=16, max_branches=3))
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0), arrive_every=2)
    outputs = [done[str(i)].output_ids for i in range(NUM_PROMPTS)]
    assert near_tie_mismatches(target_model, prompts, outputs, cuda_references) <= MAX_TIES
    assert max(r.paths for r in rounds) > 1 and sum(r.accepted for r in rounds) > 0
    assert_on_cuda(engine, compile, graphs=graphs == "on")


def sample(target, draft, kind, compile, prompts, seeds) -> tuple[list[list[int]], int]:
    """Outputs at temperature 0.8 and the number of accepted draft tokens."""
    engine = make_engine(target, kind, draft, max_num_seqs=4, max_model_len=128, compile=compile)
    params = SamplingParams(max_tokens=16, temperature=0.8)
    done, rounds = run_requests(engine, prompts, params, arrive_every=2, seeds=seeds)
    return [done[str(i)].output_ids for i in range(len(prompts))], sum(r.accepted for r in rounds)


@pytest.mark.parametrize("kind", ["draft-prob", "hybrid"])
@pytest.mark.parametrize("compile", ["off", "on"])
def test_sampling_on_cuda_reproduces(kind, compile, cuda_target, cuda_draft):
    """Model drafters only: at temperature 0.8 the n-gram drafter rarely gets a draft accepted on these
    random models' outputs (0-4 tokens per run on CPU), so it would prove nothing here."""
    vocab = cuda_target.config.vocab_size
    prompts = mixed_prompts(12, vocab, seed=1)
    seeds = [100 + i for i in range(len(prompts))]
    first, accepted = sample(cuda_target, cuda_draft, kind, compile, prompts, seeds)
    assert all(len(out) == 16 and all(0 <= t < vocab for t in out) for out in first)
    assert accepted > 0
    assert sample(cuda_target, cuda_draft, kind, compile, prompts, seeds) == (first, accepted)
    # other seeds must sample other tokens somewhere, or the seeds were ignored
    assert sample(cuda_target, cuda_draft, kind, compile, prompts, [s + 1000 for s in seeds])[0] != first


@pytest.mark.parametrize("kind", ["ngram", "draft-prob"])
def test_verification_inside_the_captured_graph_on_cuda(kind, cuda_target, cuda_draft):
    """Greedy and sampled rows (top-k) in one batch on captured graphs: verifying inside the graph
    emits, seed for seed, what verifying after the graph's forward does."""
    vocab = cuda_target.config.vocab_size
    prompts = mixed_prompts(12, vocab, seed=3)
    params = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=0.8, top_k=30)]
    outputs = []
    for inside in (True, False):
        engine = make_engine(cuda_target, kind, cuda_draft, max_num_seqs=4, max_model_len=128, g=4, cuda_graphs="on")
        engine.target.graphs.tails_enabled = inside
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params[i % 2], seed=i)
        done = {}
        while engine.has_unfinished():
            done.update({c.request_id: c.output_ids for c in engine.step().finished})
        outputs.append(done)
        g = engine.target.graphs
        assert g.enabled and g.tails_disabled_reason is None and (g.num_tails > 0) == inside
    assert outputs[0] == outputs[1]


def test_steps_run_ahead_on_cuda_emit_what_waiting_steps_do(cuda_target):
    """Each step launched before the one before it is read back (its input left on the device, its readback
    copied asynchronously): the same tokens seed for seed as steps that wait, greedy and sampled rows in one
    batch, rows ending by EOS a step before the host knows, prompts arriving while others decode."""
    vocab = cuda_target.config.vocab_size
    prompts = mixed_prompts(12, vocab, seed=4)
    params = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9)]

    def run(run_ahead: str, eos=()):
        engine = make_engine(cuda_target, "none", None, max_num_seqs=4, max_model_len=128, cuda_graphs="on",
                             run_ahead=run_ahead, eos=eos)
        done = {}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params[i % 2], seed=i)
            if i >= 4:
                done.update({c.request_id: (c.output_ids, c.finish_reason) for c in engine.step().finished})
        while engine.has_unfinished():
            done.update({c.request_id: (c.output_ids, c.finish_reason) for c in engine.step().finished})
        assert (engine.num_steps_ahead > 0) == (run_ahead == "on")
        assert engine.target.graphs.enabled and engine.target.graphs.tails_enabled
        return done

    # EOS: the two tokens the rows emit most past their first three, so that rows end at unforeseen steps
    counts = collections.Counter(t for out, _ in run("off").values() for t in out[3:])
    eos = tuple(t for t, _ in counts.most_common(2))
    ahead = run("on", eos)
    assert ahead == run("off", eos)
    assert sum(reason == "eos" for _, reason in ahead.values()) >= 2


@pytest.mark.parametrize("compile", ["off", "on"])
def test_bf16_agrees_with_fp32_on_first_tokens(compile, cuda_target, cuda_draft):
    """bf16 rounding (relative 2^-8 per op) moves logits far more than fp32 does, so it flips close
    top-2 choices, and these tiny random models (init range 0.7) diverge soon after a flip: whole
    outputs rarely agree. Measured with this engine on CPU (bf16 vs fp32, draft-greedy, three sets of
    48 prompts): the first 2 tokens agree on 88-94% of prompts, the first 4 on 67-83%. Required: the
    first BF16_PREFIX = 2 tokens agree on >= 75% of 48 prompts (6+ prompts under the lowest measured
    rate), every output complete, drafts accepted."""
    prompts = mixed_prompts(48, cuda_target.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0)
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        target, draft = copy.deepcopy(cuda_target).to(dtype), copy.deepcopy(cuda_draft).to(dtype)
        engine = make_engine(target, "draft-greedy", draft, max_num_seqs=16, max_model_len=128, compile=compile)
        done, rounds = run_requests(engine, prompts, params, arrive_every=2)
        assert engine.target.cache.keys[0].dtype == dtype and sum(r.accepted for r in rounds) > 0
        outputs[dtype] = [done[str(i)].output_ids for i in range(len(prompts))]
    assert all(len(out) == 16 for out in outputs[torch.bfloat16])
    pairs = list(zip(outputs[torch.bfloat16], outputs[torch.float32]))
    agree = {k: sum(b[:k] == f[:k] for b, f in pairs) for k in (BF16_PREFIX, 4, 16)}
    print(f"bf16 vs fp32 (compile {compile}), prompts agreeing on the first k tokens of {len(prompts)}: {agree}")
    assert agree[BF16_PREFIX] >= BF16_MIN_AGREE * len(prompts)


@pytest.mark.skipif(not os.environ.get(MODEL_DIR_ENV), reason=f"{MODEL_DIR_ENV} not set (a real checkpoint dir)")
@pytest.mark.parametrize("compile", ["off", "on"])
def test_real_model_greedy_identity_on_cuda(compile):
    """A real checkpoint in fp32: the engine with the n-gram drafter equals HF generate on CUDA, up to
    near-ties of its own top-2 logits (fp64 head on the same device)."""
    from pipeline.loading.models import ModelSpec, load_model
    model, tokenizer = load_model(ModelSpec(os.environ[MODEL_DIR_ENV], "float32", "cuda"))
    vocab = min(len(tokenizer), model.config.vocab_size)
    prompts = mixed_prompts(8, vocab, seed=5)
    references = [greedy_reference(model, p, 32) for p in prompts]
    engine = make_engine(model, "ngram", None, max_num_seqs=4, max_model_len=160, compile=compile)
    done, _ = run_requests(engine, prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    outputs = [done[str(i)].output_ids for i in range(len(prompts))]
    assert near_tie_mismatches(model, prompts, outputs, references) <= 1
