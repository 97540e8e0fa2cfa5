"""The CUDA-graph path's padded, bucketed forward (pipeline/engine/backends/cuda/graphs.py), on CPU without the
capture: what a captured graph computes is this forward on its static buffers, so buckets, pad tokens,
pad rows, the spare slot, the mask over the keys bucket and the logits' gather are all checked here.
The capture's self-check runs here over stand-in runtimes (a faithful replay, one that writes nothing,
one that raises); the CUDA capture itself needs a GPU: tests/engine/test_gpu.py.

Logits are compared with the eager runner's at fp32 (atol 1e-4: padded keys change only the
reduction's length), and greedy output with Hugging Face `generate`.
"""
import copy

import pytest
import torch

from conftest import greedy_reference, make_engine, mixed_prompts, run_requests, tiny_llama
from pipeline.engine import SamplingParams, TreeParams
from pipeline.engine.backends.cuda.graphs import MAX_Q, MAX_TOKENS, MIN_KEYS, UNCAPTURED, Bucket, policy
from pipeline.engine.core.verify_step import VerifyStep
from pipeline.engine.model.runner import build_runner

VOCAB = 512


def runners(num_slots: int, max_len: int, compile: str = "off"):
    """The eager runner (padded SDPA) and the graph path's, with attention by lengths where compile is on."""
    model = tiny_llama()
    make = lambda mode, compile="off": build_runner(copy.deepcopy(model), num_slots, max_len, packed_linear=False,
                                                    cpu_attention="off", cuda_graphs=mode, compile=compile)
    return make("off"), make(UNCAPTURED, compile)


def test_policy_and_store():
    cpu = torch.device("cpu")
    assert policy("auto", cpu) is False and policy("off", cpu) is False
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        policy("on", cpu)
    with pytest.raises(ValueError, match="engine.cuda_graphs"):
        policy("yes", cpu)
    eager, graphs = runners(3, 100)
    assert eager.graphs is None and eager.cache.num_slots == 3 and eager.cache.max_len == 100
    assert graphs.graphs is not None and graphs.graphs.capture is None
    assert graphs.cache.num_slots == 4 and graphs.cache.max_len == 100 + MAX_Q - 1   # spare slot, pad room
    # where our CPU kernels take every forward there is nothing for a graph to replay
    assert build_runner(tiny_llama(), 2, 64, cuda_graphs=UNCAPTURED).graphs is None
    # verification inside the graph: taken where the switch allows it, and nothing run where it does not
    step = VerifyStep([[5]], [SamplingParams(temperature=0)], None, None, None)
    assert graphs.forward_verify([0], [0], [[1, 5]], step).num_accepted in ([0], [1])
    off = build_runner(tiny_llama(), 3, 100, packed_linear=False, cpu_attention="off", cuda_graphs=UNCAPTURED,
                       graph_verify=False)
    assert off.forward_verify([0], [0], [[1, 5]], step) is None and off.num_forward_tokens == 0


def test_buckets():
    _, runner = runners(6, 1000)
    g = runner.graphs
    assert g.bucket([5, 7, 9], [1, 3, 2], "all") == Bucket(4, 3, MIN_KEYS, "all")
    assert g.bucket([300], [1], "last") == Bucket(1, 1, 512, "last")
    assert g.bucket([0] * 5, [1] * 5, "last").rows == 6                      # capped at the runner's slots
    assert g.bucket([990], [4], "all").keys == runner.cache.max_len          # the last keys bucket: the store
    assert g.bucket([0], [MAX_Q + 1], "all") is None                         # too many tokens per row
    assert g.bucket([0], [4], "none") is None                                # prefill: eager
    _, big = runners(128, 64)
    assert big.graphs.bucket([0] * 128, [MAX_TOKENS // 128 + 1] * 128, "all") is None


@pytest.mark.parametrize("compile", ["off", "on"], ids=["padded", "by-lengths"])
def test_logits_equal_eager_over_a_run_of_steps(compile, monkeypatch):
    """Ragged verify-like steps over non-contiguous slots, rows not a power of two, rows ending at
    max_model_len (pad tokens run into the extra positions), "all" and "last", with rollbacks: each
    step's logits equal the eager runner's, so the pad tokens' KV never leaks into a real row. By
    lengths: the graphs' attention is FlexAttention over block tables built from the row table, and
    no mask over the keys bucket is made."""
    max_len = 120
    eager, graphs = runners(5, max_len, compile)
    if compile == "on":
        from pipeline.engine.backends.cuda import graphs as graphs_module
        assert graphs.graphs.flex_tables is not None
        monkeypatch.setattr(graphs_module, "attention_masks", lambda *a: pytest.fail("a mask over padded keys"))
    gen = torch.Generator().manual_seed(0)
    slots = [4, 0, 2]
    history = {s: torch.randint(0, VOCAB, (n,), generator=gen).tolist() for s, n in zip(slots, (40, 7, 110))}
    for runner in (eager, graphs):
        runner.forward(slots, [0] * 3, [history[s] for s in slots], logits="none")
    computed = {s: len(history[s]) for s in slots}
    for step in range(8):
        rows = slots if step % 3 else slots[:2]
        new = {s: torch.randint(0, VOCAB, (1 + (step + i) % 5,), generator=gen).tolist() for i, s in enumerate(rows)}
        for s in rows:                                   # never past max_model_len (the engine's bound)
            new[s] = new[s][:max_len - computed[s]]
        rows = [s for s in rows if new[s]]
        mode = "all" if step % 2 else "last"
        args = (rows, [computed[s] for s in rows], [new[s] for s in rows])
        want, got = eager.forward(*args, logits=mode), graphs.forward(*args, logits=mode)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for s in rows:                                   # keep all but the last new token (a rollback)
            computed[s] += max(len(new[s]) - 1, 1) if computed[s] + len(new[s]) < max_len else len(new[s])
            computed[s] = min(computed[s], max_len - 1)
    assert graphs.graphs.num_replays == 8 and eager.num_forward_tokens == graphs.num_forward_tokens
    assert computed[2] >= max_len - 5                    # a row did reach the end of its slot


@pytest.mark.parametrize("kind,adaptive", [("none", False), ("ngram", False), ("draft", False), ("draft", True)])
def test_greedy_identity_through_the_graph_path(kind, adaptive, target_model, draft_model):
    """The engine with every eligible step (target and draft) on the graph path: greedy output is HF
    `generate`'s, and drafts were both accepted and rejected. Adaptive: its calibration times
    forwards through the same path, and rows draft different lengths in one step."""
    prompts = mixed_prompts(12, target_model.config.vocab_size, seed=2)
    engine = make_engine(target_model, kind, draft_model, max_num_seqs=3, max_model_len=128, g=4,
                         adaptive=adaptive, cpu_attention="off", cuda_graphs=UNCAPTURED)
    if adaptive:
        engine.calibrate()
        # the measured curves depend on the machine's load; flat ones make the policy draft, so that
        # the rounds below always have drafts to accept and reject
        engine.costs.verify_curve, engine.costs.draft_curve = [(1, 1.0), (10_000, 1.0)], [(1, 1e-6), (64, 1e-6)]
        engine.costs.ema = 0.0
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=24, temperature=0), arrive_every=2)
    for i, p in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, p, 24), f"prompt {i}"
    assert engine.target.graphs.num_replays > 0
    if kind == "draft":
        assert engine.drafter.draft_runner.graphs.num_replays > 0
    if kind != "none":
        accepted, drafted = sum(r.accepted for r in rounds), sum(r.draft_len for r in rounds)
        assert 0 < accepted < drafted


def test_config_key(tmp_path):
    from pipeline.errors import ConfigError
    from pipeline.job.config import hashed_tree, load_config
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  cuda_graphs: off\n")
    cfg = load_config(str(path))
    assert cfg.engine.cuda_graphs == "off" and load_config(None, []).engine.cuda_graphs == "auto"
    assert hashed_tree(cfg) == hashed_tree(load_config(None, []))           # not part of the output's identity
    with pytest.raises(ConfigError, match="engine.cuda_graphs"):
        load_config(str(path), ["engine.cuda_graphs=maybe"])


class RerunCapture:
    """Stands in for the CUDA runtime (cuda_graphs.CudaCapture): its "graph" replays by running the
    recorded function again, which is what a faithful capture does."""

    def __init__(self):
        self.captures = 0

    def warm_up(self, fn):
        fn()

    def capture(self, fn):
        self.captures += 1
        return fn


class NoopReplay(RerunCapture):
    """A replay that does nothing (a graph whose kernels write elsewhere, say)."""

    def capture(self, fn):
        self.captures += 1
        return lambda: None


class RaisingCapture(RerunCapture):
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def graph_engine(target_model, draft_model, backend):
    engine = make_engine(target_model, "draft", draft_model, max_num_seqs=3, max_model_len=128, g=4,
                         cpu_attention="off", cuda_graphs=UNCAPTURED)
    for runner in (engine.target, engine.drafter.draft_runner):
        runner.graphs.capture = backend
    return engine


@pytest.mark.parametrize("backend", [RerunCapture, NoopReplay, RaisingCapture])
def test_capture_self_check(backend, target_model, draft_model):
    """The capture logic over a stand-in runtime: a faithful replay keeps one graph per bucket (the
    target's verify steps: forward and verification in one); a replay that does not reproduce the
    uncaptured run, or a capture that raises, switches verification in the graph off, then graphs, with
    a warning naming why. Output is HF greedy's in all three cases."""
    prompts = mixed_prompts(12, target_model.config.vocab_size, seed=2)
    runtime = backend()
    engine = graph_engine(target_model, draft_model, runtime)
    if backend is RerunCapture:
        done, _ = run_requests(engine, prompts, SamplingParams(max_tokens=24, temperature=0), arrive_every=2)
    else:
        with pytest.warns(RuntimeWarning, match="CUDA graphs off for this model"):
            done, _ = run_requests(engine, prompts, SamplingParams(max_tokens=24, temperature=0), arrive_every=2)
    for i, p in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, p, 24), f"prompt {i}"
    graphs = [engine.target.graphs, engine.drafter.draft_runner.graphs]
    if backend is RerunCapture:
        assert all(g.enabled and g.num_graphs > 0 for g in graphs)
        assert runtime.captures == sum(g.num_graphs for g in graphs)       # each bucket captured once
        assert engine.target.graphs.tails_enabled and engine.target.graphs.num_tails > 0
    else:
        reason = "differs from its uncaptured run" if backend is NoopReplay else "operation not permitted"
        assert all(not g.enabled and reason in g.disabled_reason and g.num_graphs == 0 for g in graphs)
        target = engine.target.graphs
        assert not target.tails_enabled and reason in target.tails_disabled_reason
        assert all(g.bucket([0], [1], "last") is None for g in graphs)      # eager from then on


@pytest.mark.parametrize("kind", ["none", "ngram", "draft-prob", "ngram-tree", "suffix-tree"])
def test_verification_inside_the_graph_emits_what_verification_after_it_does(kind, target_model, draft_model):
    """Greedy and sampled rows (top-k, top-p, min-p, penalties) in one batch, one-hot and dense q, paths
    and token trees, slots reused as rows finish: the engine verifying inside the graph's step
    (core/verify_step.py) emits, token for token and seed for seed, what it emits verifying after the
    graph's forward; drafts were both accepted and rejected, trees had branches."""
    tree, kind = kind.endswith("-tree"), kind.removesuffix("-tree")
    prompts = mixed_prompts(10, target_model.config.vocab_size, seed=4)
    params = [SamplingParams(max_tokens=40, temperature=0), SamplingParams(max_tokens=40, temperature=0.8, top_k=20,
                                                                           top_p=0.9),
              SamplingParams(max_tokens=40, temperature=1.0, min_p=0.05),
              SamplingParams(max_tokens=40, temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(max_tokens=40, temperature=0, frequency_penalty=0.4)]
    outputs = []
    for inside in (True, False):
        engine = make_engine(target_model, kind, draft_model, max_num_seqs=4, max_model_len=128, g=4,
                             cpu_attention="off", cuda_graphs=UNCAPTURED,
                             tree=TreeParams(max_tokens=8, max_branches=3) if tree else TreeParams())
        engine.target.graphs.tails_enabled = inside
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params[i % len(params)], seed=i)
        done, rounds = {}, []
        while engine.has_unfinished():
            out = engine.step()
            done.update({c.request_id: c.output_ids for c in out.finished})
            rounds += out.rounds
        outputs.append(done)
        assert (engine.target.graphs.num_tails > 0) == inside
        if kind != "none":
            accepted, drafted = sum(r.accepted for r in rounds), sum(r.draft_len for r in rounds)
            assert 0 < accepted < drafted
        if tree:
            assert max(r.paths for r in rounds) > 1
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("tree", [False, True], ids=["paths", "trees"])
def test_greedy_identity_with_attention_by_lengths_in_the_graph_path(tree, target_model):
    """compile on: the graph path's attention is FlexAttention from the row table (paths, and trees with
    their visibility bits); greedy output is HF `generate`'s, verification inside the graph."""
    prompts = mixed_prompts(8, target_model.config.vocab_size, seed=6)
    engine = make_engine(target_model, "ngram", None, max_num_seqs=3, max_model_len=128, g=4, compile="on",
                         cpu_attention="off", cuda_graphs=UNCAPTURED,
                         tree=TreeParams(max_tokens=8, max_branches=3) if tree else TreeParams())
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=24, temperature=0), arrive_every=2)
    for i, p in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, p, 24), f"prompt {i}"
    g = engine.target.graphs
    assert g.flex_tables is not None and g.num_replays > 0 and g.num_tails > 0
    assert sum(r.accepted for r in rounds) > 0
    if tree:
        assert max(r.paths for r in rounds) > 1


def test_a_failed_capture_turns_attention_by_lengths_off_first(target_model, draft_model):
    """Over a runtime whose capture raises, with compile on: attention by lengths goes first, then
    verification inside the graph, then graphs, each with a warning; output is HF greedy's."""
    prompts = mixed_prompts(6, target_model.config.vocab_size, seed=2)
    engine = make_engine(target_model, "ngram", None, max_num_seqs=3, max_model_len=128, g=4, compile="on",
                         cpu_attention="off", cuda_graphs=UNCAPTURED)
    engine.target.graphs.capture = RaisingCapture()
    with pytest.warns(RuntimeWarning) as caught:
        done, _ = run_requests(engine, prompts, SamplingParams(max_tokens=16, temperature=0), arrive_every=2)
    for i, p in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, p, 16), f"prompt {i}"
    said = [str(w.message) for w in caught]
    order = [next(i for i, m in enumerate(said) if m.startswith(start)) for start in (
        "attention by lengths off", "verification runs after the graph", "CUDA graphs off")]
    assert order == sorted(order), said
    g = engine.target.graphs
    assert g.flex_tables is None and not g.tails_enabled and not g.enabled
