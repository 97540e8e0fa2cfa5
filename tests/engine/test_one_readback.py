"""A step reads the device back once: the engine's round runs on CPU under modes that count every read of
a tensor's values into Python (`tolist`, `item`, `bool`, `int`, `numpy`, `cpu`) and every op whose output
shape depends on values (`nonzero`, boolean indexing, `masked_select`, `unique`, `repeat_interleave`
without its output size). On a GPU each of these waits for the device; the step's one readback is
VerifyOutput.to_host. Uniforms drawn from a sequence's own CPU generator are host data, not reads.

What still reads back, and is counted so that it cannot grow unseen: a draft model's proposal reads its
tokens once per round (each draft step's input comes from the device; penalty counts are updated there),
once per draft step under a grammar (which advances on the host). The sampled walk over a token tree makes a fixed
number of tries on a GPU (core/verify_rule.py's FIXED_WALK) and reads nothing; on a CPU it walks only the
rows still going and reads whether any is, once per try.

The runner takes the bucketed graph path (uncaptured on CPU: tests/engine/backends/test_cuda_graphs.py)
for verify steps and the eager path for prompt chunks, as on a GPU; prompts arrive while others decode.
Steps verify inside the graph (core/verify_step.py) and read back its output (ModelRunner.forward_verify),
or, with verification inside the graph off, after it (VerifyOutput.to_host): both are counted, and so are
steps run ahead (engine.run_ahead), whose inputs stay on the device.
"""
from __future__ import annotations

import collections
import copy
import traceback
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import make_engine, mixed_prompts, tiny_llama
from pipeline.engine import SamplingParams
from pipeline.engine.backends.cuda.graphs import UNCAPTURED
from pipeline.engine.config import TreeParams
from pipeline.engine.core import verify_rule

READS = {"tolist", "numpy", "cpu", "item", "__bool__", "__int__", "__float__", "__index__"}
VALUE_SHAPED = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique2",
                "unique_consecutive", "unique_dim"}


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/pipeline/" in f.filename]
    return f"{frames[-1].filename.split('pipeline/')[-1]}:{frames[-1].lineno}" if frames else "?"


class _PythonReads(TorchFunctionMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts, self.host = counts, {}         # id -> weakref of host-drawn tensors

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS and not (args and self._drawn_on_host(args[0])):
            self.counts[(name, _caller())] += 1
        out = func(*args, **kwargs)
        generator = kwargs.get("generator")
        if generator is not None and generator.device.type == "cpu" and isinstance(out, torch.Tensor):
            self.host[id(out)] = weakref.ref(out)      # drawn on the host: reading it waits for nothing
        return out

    def _drawn_on_host(self, x) -> bool:
        ref = self.host.get(id(x))
        return ref is not None and ref() is x


class _ValueShapedOps(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        shaped = name in VALUE_SHAPED
        shaped |= (name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor)
                   and kwargs.get("output_size") is None)
        shaped |= name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None)
        if shaped and name != "_local_scalar_dense":    # item/bool/int: counted once, as Python reads
            self.counts[(f"aten.{name}", _caller())] += 1
        return func(*args, **kwargs)


def count_reads(engine, steps: int, arrivals: list[tuple[str, list[int], SamplingParams]]):
    """Run up to `steps` steps (the arrivals queued first, so their prompt chunks run inside the counted
    steps); returns, per step that verified (a step whose rows are all still in their prompts verifies
    nothing), the Counter of its (read, where)."""
    counts: collections.Counter = collections.Counter()
    per_step = []
    with _PythonReads(counts), _ValueShapedOps(counts):
        for rid, prompt, params in arrivals:
            engine.add_request(rid, prompt, params)
        for _ in range(steps):
            if not engine.has_unfinished():
                break
            counts.clear()
            if engine.step().rounds:
                per_step.append(collections.Counter(counts))
            else:
                assert not counts, dict(counts)
    return per_step


GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                         presence_penalty=0.2)
FILTERED = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01)   # no penalties
TREE = TreeParams(max_tokens=8)


@pytest.fixture(scope="module")
def models():
    return tiny_llama(), tiny_llama(seed=1)


def _run(models, kind: str, params: SamplingParams, tree: TreeParams = TreeParams(), inside: bool = True,
         run_ahead: str = "off"):
    target, draft = models
    engine = make_engine(target, kind, draft if kind in ("draft", "hybrid") else None, max_num_seqs=4,
                         max_model_len=160, g=4, cpu_attention="off", cuda_graphs=UNCAPTURED, tree=tree,
                         run_ahead=run_ahead)
    engine.target.graphs.tails_enabled = inside
    prompts = mixed_prompts(8, target.config.vocab_size, seed=5)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), p, params)
    for _ in range(3):                       # warm-up: first-use probes (the bitmask kernel's) are not steps
        engine.step()
    steps = count_reads(engine, 30, [(str(i + 4), p, params) for i, p in enumerate(prompts[4:])])
    assert len(steps) >= 20
    assert (engine.target.graphs.num_tails > 0) == inside
    assert (engine.num_steps_ahead > 0) == (run_ahead == "on")
    return steps


def _only_the_readback(counts: collections.Counter) -> bool:
    """The step's reads are its one readback: the graph's verify output (core/verify_step.py's Readback)
    or VerifyOutput.to_host's."""
    reads = list(counts.elements())
    return len(reads) == 1 and reads[0][0] == "tolist" and (
        "engine/core/verify.py" in reads[0][1] or "engine/core/verify_step.py" in reads[0][1])


def _split(counts: collections.Counter, where: str) -> tuple[collections.Counter, collections.Counter]:
    mine = collections.Counter({k: v for k, v in counts.items() if where in k[1]})
    return mine, counts - mine


@pytest.mark.parametrize("kind,params,tree", [
    ("none", GREEDY, TreeParams()), ("none", SAMPLED, TreeParams()), ("none", FILTERED, TreeParams()),
    ("ngram", GREEDY, TreeParams()), ("ngram", SAMPLED, TreeParams()), ("ngram", FILTERED, TreeParams()),
    ("suffix", GREEDY, TreeParams()), ("suffix", SAMPLED, TreeParams()),
    ("ngram", GREEDY, TREE), ("suffix", GREEDY, TREE),
], ids=["none-greedy", "none-sampled", "none-filtered", "ngram-greedy", "ngram-sampled", "ngram-filtered",
        "suffix-greedy", "suffix-sampled", "ngram-tree-greedy", "suffix-tree-greedy"])
@pytest.mark.parametrize("inside", [True, False], ids=["inside", "after"])
def test_a_step_reads_the_device_back_once(models, kind, params, tree, inside):
    for counts in _run(models, kind, params, tree, inside):
        assert _only_the_readback(counts), dict(counts)


@pytest.mark.parametrize("params", [GREEDY, FILTERED], ids=["greedy", "filtered"])
def test_a_step_run_ahead_reads_the_device_back_once(models, params):
    """A step launched before the previous one is read back (engine.run_ahead) takes each row's input on
    the device: it reads back its own output once, and nothing else."""
    for counts in _run(models, "none", params, run_ahead="on"):
        assert _only_the_readback(counts), dict(counts)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, FILTERED], ids=["greedy", "sampled", "filtered"])
@pytest.mark.parametrize("kind", ["draft", "hybrid"])
def test_a_draft_model_reads_its_proposal_once(models, kind, params):
    """Each draft step's input is the previous step's token on the device (sampled rows: with penalties,
    counted on the device): one read for all the round's draft tokens, g = 4 steps."""
    drafted = 0
    for counts in _run(models, kind, params):
        draft_reads, rest = _split(counts, "drafting/draft_model.py")
        assert _only_the_readback(rest), dict(rest)
        assert set(name for name, _ in draft_reads) <= {"tolist"} and sum(draft_reads.values()) <= 1, dict(draft_reads)
        drafted += sum(draft_reads.values())
    assert drafted > 0


def test_the_sampled_tree_walk_of_fixed_tries_reads_nothing(models, monkeypatch):
    monkeypatch.setattr(verify_rule, "FIXED_WALK", {"cpu", "cuda"})
    for counts in _run(models, "suffix", SAMPLED, TREE, inside=False):
        assert _only_the_readback(counts), dict(counts)


def test_the_sampled_tree_walk_of_live_rows_reads_once_per_try(models):
    walked = 0
    for counts in _run(models, "suffix", SAMPLED, TREE, inside=False):
        walk, rest = _split(counts, "core/verify_tree.py")
        assert _only_the_readback(rest), dict(rest)
        tries = sum(v for (name, _), v in walk.items() if name == "__bool__")
        assert tries <= 4 * TREE.max_tokens + 1      # a try per node of the 4 rows' trees at most, and the last
        walked += tries
    assert walked > 0


def test_the_counter_sees_a_read_and_a_value_shaped_op():
    """The modes above can fail: an item() and a nonzero in engine code are counted."""
    counts: collections.Counter = collections.Counter()
    x = torch.tensor([0, 3, 0, 5])
    with _PythonReads(counts), _ValueShapedOps(counts):
        from pipeline.engine.core import verify
        verify.first_rejections(torch.tensor([True, False]), torch.tensor([0, 2])).tolist()
        int(x.sum())
        x.nonzero()
        x[x > 0]
    names = collections.Counter(name for name, _ in counts.elements())
    assert names["tolist"] == 1 and names["__int__"] == 1 and names["aten.nonzero"] == 1
    assert names["aten.index"] == 1


@pytest.mark.parametrize("switches", [dict(), dict(cpu_attention="off"),
                                      dict(cpu_attention="off", cuda_graphs=UNCAPTURED)],
                         ids=["cpu-loop", "modules", "graph-path"])
def test_last_tokens_on_the_device_compute_what_the_host_tokens_do(models, switches):
    """ModelRunner.forward's last_tokens (a draft model's next inputs, never read back): each row's last
    token taken from the device gives bitwise the logits and KV of passing it in the row's list."""
    from pipeline.engine.model.runner import build_runner
    target, _ = models
    runners = [build_runner(copy.deepcopy(target), 4, 64, **switches) for _ in range(2)]
    prompts = [[5, 9, 2, 7], [3, 3], [11, 4, 8]]
    for runner in runners:
        runner.forward([0, 1, 2], [0] * 3, [p[:-1] for p in prompts], logits="none")
    starts = [len(p) - 1 for p in prompts]
    want = runners[0].forward([0, 1, 2], starts, [p[-1:] for p in prompts], logits="last")
    got = runners[1].forward([0, 1, 2], starts, [[0]] * 3, logits="last",
                             last_tokens=torch.tensor([p[-1] for p in prompts]))
    assert torch.equal(got, want)
    assert "cuda_graphs" not in switches or runners[1].graphs.num_replays > 0
    for name in ("keys", "values"):
        for a, b in zip(getattr(runners[0].cache, name), getattr(runners[1].cache, name)):
            assert torch.equal(a, b)
