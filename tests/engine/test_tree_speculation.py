"""Token trees through the engine: greedy output identical to target-only greedy decoding (HF
`generate`) for suffix and n-gram trees at batch 1, 4 and 32, on every forward path (our CPU kernels
in one loop, under the model's modules, padded SDPA, compiled FlexAttention, the CUDA graphs' padded
forward run uncaptured), fixed and adaptively sized; where tokens differ, the first difference must
sit on a near-tie of the target's top-2 logits. The runs must exercise trees: rounds with more than
one path, and accepted paths that leave the first branch (what a single path would not accept).
Sampled output's exactness under trees: tests/engine/core/test_tree_verify.py and the end-to-end
enumeration (tests/engine/test_end_to_end_distribution.py, tree cases)."""
import pytest

from conftest import greedy_references_fixture, make_engine, mixed_prompts_fixture, near_tie_mismatches, run_requests
from pipeline.engine import SamplingParams, TreeParams
from pipeline.engine.backends.cuda.graphs import UNCAPTURED
from pipeline.engine.core.tree import children

NUM_PROMPTS, MAX_NEW = 40, 24
TREE = TreeParams(max_tokens=12, max_branches=3)
PATHS = {
    "cpu": dict(cpu_attention="on", cpu_decoder="on"),
    "modules": dict(cpu_attention="on", cpu_decoder="off"),
    "sdpa": dict(cpu_attention="off"),
    "flex": dict(cpu_attention="off", compile="on"),
    "graphs": dict(cpu_attention="off", cuda_graphs=UNCAPTURED),
}


prompts = mixed_prompts_fixture(NUM_PROMPTS, seed=9)
references = greedy_references_fixture(MAX_NEW)


def off_first_branch(rounds, parents_seen) -> int:
    """Rounds whose accepted path is not the tree's first-child path."""
    count = 0
    for r, parents in zip(rounds, parents_seen):
        if parents is None or not r.accepted:
            continue
        kids, node, first = children(parents), -1, []
        while kids[node + 1]:
            node = kids[node + 1][0]
            first.append(node)
        accepted = [i for i, ok in enumerate(r.accepted_mask) if ok]
        count += accepted != first[:len(accepted)]
    return count


def run_checked(engine, target_model, prompts, references):
    seen = {}
    propose = engine.drafter.propose

    def recording(seqs, *args, **kwargs):
        batch = propose(seqs, *args, **kwargs)
        for b, s in enumerate(seqs):
            seen[(s.request_id, s.num_rounds)] = batch.parents[b] if batch.is_tree else None
        return batch
    engine.drafter.propose = recording
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0), arrive_every=3)
    outputs = [done[str(i)].output_ids for i in range(len(prompts))]
    assert near_tie_mismatches(target_model, prompts, outputs, references) <= 2
    parents = [seen.get((r.request_id, r.round)) for r in rounds]
    return rounds, parents


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 4, 32])
@pytest.mark.parametrize("kind", ["suffix", "ngram"])
def test_greedy_identity_with_trees(target_model, prompts, references, kind, batch_size):
    engine = make_engine(target_model, kind, max_num_seqs=batch_size, max_model_len=128, g=4, tree=TREE)
    rounds, parents = run_checked(engine, target_model, prompts, references)
    assert max(r.paths for r in rounds) > 1, "no round drafted a tree"
    assert sum(r.accepted for r in rounds) > 0
    assert off_first_branch(rounds, parents) > 0, "no accepted path left the first branch"
    assert max(r.batch_size for r in rounds) >= min(batch_size, NUM_PROMPTS // 2)   # half arrive up front


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in PATHS if p != "cpu"])
def test_greedy_identity_with_trees_on_every_path(target_model, prompts, references, path):
    engine = make_engine(target_model, "suffix", max_num_seqs=4, max_model_len=128, g=4, tree=TREE, **PATHS[path])
    rounds, parents = run_checked(engine, target_model, prompts, references)
    assert max(r.paths for r in rounds) > 1 and off_first_branch(rounds, parents) > 0


@pytest.mark.slow
def test_adaptive_tree_sizes_keep_identity(target_model, prompts, references):
    engine = make_engine(target_model, "suffix", max_num_seqs=4, max_model_len=128, g=4, tree=TREE, adaptive=True)
    rounds, _ = run_checked(engine, target_model, prompts, references)
    sizes = {r.draft_len for r in rounds}
    assert len(sizes) > 2, f"adaptive sizing chose only {sizes}"
    assert engine.lengths.policy.tree_calibration, "tree rounds were observed"


def test_no_lookup_where_no_tree_could_pay(target_model, prompts, references):
    """Adaptive trees on a verify curve where no draft token can pay its cost: the engine never asks
    the drafter for a tree (each lookup would be discarded) and the output is still greedy's."""
    engine = make_engine(target_model, "ngram", max_num_seqs=4, max_model_len=128, g=4, tree=TREE, adaptive=True)
    engine.costs.verify_curve = [(1, 1.0), (2, 4.0), (64, 200.0)]       # a token costs 3 steps
    asked = []
    lookup = engine.drafter.lookup_tree
    engine.drafter.lookup_tree = lambda seq, size, *rest: asked.append(size) or lookup(seq, size, *rest)
    done, rounds = run_requests(engine, prompts[:8], SamplingParams(max_tokens=MAX_NEW, temperature=0))
    assert [done[str(i)].output_ids for i in range(8)] == references[:8]
    assert not any(asked) and all(r.draft_len == 0 for r in rounds)
    engine.costs.verify_curve = [(1, 1.0), (64, 1.0)]                     # weight-bound: trees pay
    done, rounds = run_requests(engine, prompts[8:16], SamplingParams(max_tokens=MAX_NEW, temperature=0),
                                ids=[str(i) for i in range(8, 16)])
    assert any(asked) and max(r.draft_len for r in rounds) > 0


def test_refused_trees_are_retried(target_model, prompts, references):
    """Trees the calibration says accept nothing, on a curve where each token costs 0.1 of a step: the
    first steps ask the drafter for none; each refused step fades that evidence, so trees are asked for
    again at the same batch size before the run ends (never, if refusals forgot nothing), and the output
    is still greedy's."""
    engine = make_engine(target_model, "ngram", max_num_seqs=4, max_model_len=128, g=4, tree=TREE, adaptive=True)
    engine.costs.verify_curve = [(1, 1.0), (64, 7.3)]           # V(T) = 1 + 0.1 (T - 1)
    for _ in range(2):           # c_1 = 1 / (1.98 + 2) ~ 0.25: at batch 4 a token pays above 0.4 / 1.3 ~ 0.31
        engine.lengths.policy.observe_tree([1.0] * 4, [-1, 0, 1, 2], 0)
    assert not engine.lengths.policy.tree_may_pay(4, TREE.max_tokens)
    asked = []
    lookup = engine.drafter.lookup_tree
    engine.drafter.lookup_tree = lambda seq, size, *rest: (
        size and asked.append((engine.num_steps, len(engine.scheduler.running))) or lookup(seq, size, *rest))
    done, rounds = run_requests(engine, prompts[:8], SamplingParams(max_tokens=MAX_NEW, temperature=0))
    assert [done[str(i)].output_ids for i in range(8)] == references[:8]
    at_four = [step for step, running in asked if running == 4]
    assert at_four, "trees were never asked for again at batch 4"
    assert min(at_four) >= 20, f"trees asked for at step {min(at_four)}: the calibration was not refusing them"


def test_refused_offers_fade_the_calibration(target_model, prompts, references):
    """Where the policy keeps no token of the trees a step's lookup offered, the engine drafts nothing
    that step and the calibration's evidence fades (forget_trees), as where no lookup is made; a step
    that keeps a token forgets nothing."""
    engine = make_engine(target_model, "ngram", max_num_seqs=4, max_model_len=128, g=4, tree=TREE, adaptive=True)
    engine.costs.verify_curve = [(1, 1.0), (64, 1.0)]           # weight-bound: every lookup is made
    sizes = engine.lengths.policy.tree_sizes
    refuse = {"on": True}
    engine.lengths.policy.tree_sizes = lambda scores, parents: (
        [0] * len(scores) if refuse["on"] else sizes(scores, parents))
    forgot = []
    forget = engine.lengths.policy.forget_trees
    engine.lengths.policy.forget_trees = lambda *a: forgot.append(engine.num_steps) or forget(*a)
    done, rounds = run_requests(engine, prompts[:4], SamplingParams(max_tokens=MAX_NEW, temperature=0))
    assert [done[str(i)].output_ids for i in range(4)] == references[:4]
    assert all(r.draft_len == 0 for r in rounds)
    assert forgot, "refused offers did not fade the calibration"
    refuse["on"], forgot[:] = False, []
    done, rounds = run_requests(engine, prompts[4:8], SamplingParams(max_tokens=MAX_NEW, temperature=0),
                                ids=[str(i) for i in range(4, 8)])
    assert [done[str(i)].output_ids for i in range(4, 8)] == references[4:8]
    kept = {r.step for r in rounds if r.draft_len}
    assert kept and not kept & set(forgot)
