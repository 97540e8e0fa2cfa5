"""The exactness matrix: every combination of drafting switches the config admits, end to end through
SpecEngine (assembled as a job assembles it: pipeline/job/runtime.py), its rows beside rows of other
kinds, at batch 1 and in a mixed batch, against the target's exact law.

Drafting, the keys a method reads, each at every value the config admits (60 combinations): method
{none, ngram, suffix, draft, hybrid} x hybrid_proposer {ngram, suffix} x the draft model's q
(draft_sample_method greedy: one-hot, probabilistic: drawn) x the lookup's q (suffix paths:
suffix.sample_method; suffix trees: tree.sampled) x shape {single path, a tree of <= 6 tokens and 3
branches} x adaptive {off, on} x forced_tokens {on, off}. Refused at config load, naming both keys
(test_refused_combinations): trees with none / draft / hybrid, tree.sampled beside anything but a
suffix tree. Rows (12 kinds): grammar {none, the regex [abc][ab]*\\}} x penalties {off, repetition
1.3 + presence 0.8} x sampling {greedy, temperature 1, temperature 0.7 + top-k 6 + top-p 0.9 + min-p
0.1}. Batch: 1 (one row at a time), or mixed (32 at once: every row kind queued in turn).

A cell (drafting, row kind, batch) passes when
  greedy: every output is token-identical to the target alone (HF forwards, numpy penalties, the
  grammar's mask from llguidance's matcher), on prompts whose greedy paths have no near-tie (a top-2
  logit gap >= 1e-3, so the engine's batched fp32 rounding cannot flip them);
  sampled: N outputs of one prompt (3 tokens, or fewer ending in EOS) fit the exact law, enumerated
  from the target's processed distributions (references.exact_law), by a chi-square test over prefix
  bins at level FAMILY_ALPHA / M, M the sampled cells this run holds (Bonferroni): a correct engine
  fails some cell of a run with probability at most FAMILY_ALPHA = 1e-4. Seeds are fixed: reruns
  reproduce. Mixed runs hold every row kind, the cells' own at N and the others (fillers) at
  N_FILLER, whose outputs must be possible outputs.
Each cell must have drafted (a method that drafts) and, sampled at a fixed length, seen acceptances
and rejections (an adaptive policy may stop drafting where drafts fail: a greedy draft model under
temperature 1); fixed tree cells must have drafted trees of more than one path, greedy cells under
the grammar with forced_tokens forced tokens.

Adaptive cells run on a fixed cost model (COSTS, rescaling off: set, not timed), so their choices
repeat from run to run; the policy's logic is the job's.

CI runs a pairwise covering array of the cells (every two factor values that occur together occur
together in some chosen cell): `pytest --matrix full` runs all 1,440. Mutants (end of the file):
each must fail the cells that exercise it at the full product's level, FAMILY_ALPHA / 960.
"""
from __future__ import annotations

import collections
import copy
import functools
import itertools
import random
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

import pipeline.engine.engine as engine_module
from conftest import tiers
from pipeline.engine import DraftingConfig, EngineConfig, SamplingParams, SuffixParams, TreeParams
from pipeline.errors import ConfigError
from pipeline.job.config import load_config
from pipeline.job.runtime import assemble_engine
from references import (TINY_EOS, TINY_TOKENS, binned_pvalue, exact_law, grammar_mask, covering_array, interactions, processed,
                        tiny_grammars)

VOCAB, LENGTH, GREEDY_LENGTH = len(TINY_TOKENS), 3, 8
N, N_FILLER, MIXED_SLOTS, FAMILY_ALPHA = 2000, 200, 32, 1e-4
PROMPT = [5, 1, 3, 5, 5, 1, 5, 2, 5, 1, 4, 6, 5, 1]   # after "5 1": 3, 5, 4, each likely for the target
TREE = TreeParams(max_tokens=6, max_branches=3)
# a step's cost: a first draft token costs half a step, the next few little, then each more (trees
# are kept whole, in part or not at all, by their estimates, at batch 1 and at 32)
COSTS = dict(verify_curve=[(1, 1.0), (2, 1.45), (3, 1.5), (8, 1.6), (64, 3.0), (512, 12.0)],
             draft_curve=[(1, 0.05), (32, 0.2)], draft_prefill_s=0.002)
SAMPLINGS = {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0),
             "t07": dict(temperature=0.7, top_k=6, top_p=0.9, min_p=0.1)}
PENALTIES = {"plain": {}, "penalised": dict(repetition_penalty=1.3, presence_penalty=0.8)}
GRAMMARS = {"free": None, "regex": {"type": "regex", "regex": r"[abc][ab]*\}"}}


@dataclass(frozen=True)
class Row:
    """A kind of row: its sampling parameters."""
    grammar: str
    penalties: str
    sampling: str

    @property
    def name(self) -> str:
        return f"{self.grammar}-{self.penalties}-{self.sampling}"

    @property
    def is_greedy(self) -> bool:
        return self.sampling == "greedy"

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=GREEDY_LENGTH if self.is_greedy else LENGTH, response_format=GRAMMARS[
            self.grammar], **PENALTIES[self.penalties], **SAMPLINGS[self.sampling])


ROWS = [Row(*kind) for kind in itertools.product(GRAMMARS, PENALTIES, SAMPLINGS)]


@dataclass(frozen=True)
class Drafting:
    """A combination of drafting switches: the keys its method reads ("-": a key it does not read)."""
    method: str
    proposer: str = "-"       # hybrid's lookup: ngram | suffix
    draft_q: str = "-"        # draft model: one-hot (greedy) | drawn (probabilistic)
    lookup_q: str = "-"       # suffix: one-hot | drawn (paths: suffix.sample_method, trees: tree.sampled)
    shape: str = "path"       # path | tree
    adaptive: bool = False
    forced: bool = True

    @property
    def name(self) -> str:
        parts = [self.method, self.proposer, f"q:{self.draft_q}", f"lookup:{self.lookup_q}", self.shape,
                 "adaptive" if self.adaptive else "fixed", "forced" if self.forced else "unforced"]
        return "-".join(p for p in parts if not p.endswith("-") and p != "-")

    def config(self) -> DraftingConfig:
        drawn = self.lookup_q == "drawn"
        return DraftingConfig(
            method=self.method, adaptive=self.adaptive, forced_tokens=self.forced,
            hybrid_proposer=self.proposer if self.proposer != "-" else "ngram",
            draft_sample_method="probabilistic" if self.draft_q == "drawn" else "greedy",
            suffix=SuffixParams(sample_method="probabilistic" if drawn and self.shape == "path" else "greedy"),
            tree=replace(TREE, sampled=drawn) if self.shape == "tree" else TreeParams())


def canonical(cfg: DraftingConfig) -> Drafting:
    """The combination a config is, setting aside the keys its method does not read."""
    trees = cfg.tree.max_tokens > 0
    lookup_drawn = cfg.tree.sampled if trees else cfg.suffix.sample_method == "probabilistic"
    return Drafting(cfg.method, cfg.hybrid_proposer if cfg.method == "hybrid" else "-",
                    ("drawn" if cfg.draft_sample_method == "probabilistic" else "one-hot")
                    if cfg.uses_draft_model else "-",
                    ("drawn" if lookup_drawn else "one-hot") if cfg.uses_suffix else "-",
                    "tree" if trees else "path", cfg.adaptive, cfg.forced_tokens)


def draftings() -> list[Drafting]:
    out = []
    for adaptive, forced in itertools.product((False, True), (True, False)):
        both = dict(adaptive=adaptive, forced=forced)
        out.append(Drafting("none", **both))
        out += [Drafting("ngram", shape=shape, **both) for shape in ("path", "tree")]
        out += [Drafting("suffix", lookup_q=q, shape=shape, **both)
                for shape, q in itertools.product(("path", "tree"), ("one-hot", "drawn"))]
        out += [Drafting("draft", draft_q=q, **both) for q in ("one-hot", "drawn")]
        out += [Drafting("hybrid", "ngram", q, **both) for q in ("one-hot", "drawn")]
        out += [Drafting("hybrid", "suffix", q, lq, **both)
                for q, lq in itertools.product(("one-hot", "drawn"), ("one-hot", "drawn"))]
    return out


@dataclass(frozen=True)
class Cell:
    drafting: Drafting
    row: Row
    batch: str                # "1" | "mixed"

    @property
    def name(self) -> str:
        return f"{self.drafting.name}/{self.row.name}/batch-{self.batch}"

    def factors(self) -> dict:
        d = self.drafting
        return dict(method=d.method, proposer=d.proposer, draft_q=d.draft_q, lookup_q=d.lookup_q, shape=d.shape,
                    adaptive=d.adaptive, forced=d.forced, grammar=self.row.grammar, penalties=self.row.penalties,
                    sampling=self.row.sampling, batch=self.batch)


DRAFTING_FACTORS = ("method", "proposer", "draft_q", "lookup_q", "shape", "adaptive", "forced")
ALL_CELLS = [Cell(d, r, b) for d in draftings() for b in ("1", "mixed") for r in ROWS]   # a run's cells in a row
M_FULL = sum(not c.row.is_greedy for c in ALL_CELLS)


def selected_cells(mode: str) -> list[Cell]:
    if mode == "full":
        return ALL_CELLS
    chosen = {tuple(sorted(f.items())) for f in covering_array([c.factors() for c in ALL_CELLS], DRAFTING_FACTORS)}
    return [c for c in ALL_CELLS if tuple(sorted(c.factors().items())) in chosen]


# the fast tier's cells (`-m "not slow"`): adaptive n-gram trees, and the hybrid of a drawing draft model and the
# suffix index's drawn drafts under a grammar; every other cell runs in the whole suite
FAST_CELLS = ("ngram-tree-adaptive-forced/free-plain-t1/batch-mixed",
              "hybrid-suffix-q:drawn-lookup:drawn-path-fixed-forced/regex-plain-t07/batch-mixed")


def pytest_generate_tests(metafunc):
    if "cell" in metafunc.fixturenames:
        cells = selected_cells(metafunc.config.getoption("--matrix"))
        metafunc.parametrize("cell", [c if c.name in FAST_CELLS else pytest.param(c, marks=pytest.mark.slow)
                                      for c in cells], ids=[c.name for c in cells])


# ---- models, references -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grammars():
    return tiny_grammars()


class Reference:
    """The target alone, in numpy: processed distributions after any prefix, the exact law of a row
    kind's outputs, greedy paths and their closest top-2 gap."""

    def __init__(self, model, grammars):
        self.model, self.grammars = model, grammars

    @functools.cache
    def logits(self, tokens: tuple) -> np.ndarray:
        with torch.no_grad():
            return self.model(input_ids=torch.tensor([list(tokens)])).logits[0, -1].double().numpy()

    def probs(self, prompt: tuple, prefix: tuple, row: Row, temperature: float | None = None) -> np.ndarray:
        """The row kind's distribution after prompt + prefix (at another temperature, if given)."""
        params = row.params()
        mask = grammar_mask(self.grammars, params, prefix) if params.response_format else None
        if temperature is not None:
            params = replace(params, temperature=temperature)
        return processed(self.logits(prompt + prefix), list(prompt), list(prefix), params, mask)

    @functools.cache
    def law(self, row: Row) -> dict[tuple, float]:
        return exact_law(lambda prefix: self.probs(tuple(PROMPT), prefix, row), LENGTH, {TINY_EOS})

    @functools.cache
    def greedy(self, prompt: tuple, row: Row) -> tuple[list[int], float]:
        """The greedy output and the smallest top-2 gap of the processed logits along it."""
        out, gap = (), np.inf
        while len(out) < GREEDY_LENGTH and (not out or out[-1] != TINY_EOS):
            probs = self.probs(prompt, out, row, temperature=1.0)      # greedy rows have no filters
            top = np.sort(np.log(np.maximum(probs, 1e-300)))[::-1]
            gap = min(gap, top[0] - top[1])
            out += (int(np.argmax(probs)),)
        return list(out), gap


@pytest.fixture(scope="module")
def reference(enumerable_models, grammars):
    return Reference(enumerable_models[0], grammars)


@pytest.fixture(scope="module")
def greedy_prompts(reference):
    """Six prompts whose greedy paths under every greedy row kind keep a top-2 gap >= 1e-3: three repeat
    a motif (lookups find long matches), three are PROMPT's shape, a pair of tokens followed by three
    different ones and then again (lookups find several continuations: trees branch)."""
    rng, chosen = random.Random(3), []
    while len(chosen) < 6:
        token = lambda: rng.randrange(1, VOCAB)
        if len(chosen) % 2:
            x, y = token(), token()
            prompt = tuple(t for _ in range(3) for t in (x, y, token(), token())) + (x, y)
        else:
            prompt = tuple(([token() for _ in range(rng.randint(2, 4))] * 6)[:rng.randint(5, 14)])
        if all(reference.greedy(prompt, row)[1] >= 1e-3 for row in ROWS if row.is_greedy):
            chosen.append(prompt)
    return chosen


# ---- runs -------------------------------------------------------------------------------------------
@dataclass
class RowResult:
    outputs: dict[str, list[int]]         # request id -> output ids
    drafted: int = 0                      # the drafter's own tokens (not forced ones)
    accepted: int = 0
    forced: int = 0
    trees: int = 0                        # rounds whose draft had more than one path
    probed: int = 0                       # adaptive trees: sampled rows' proposals drawn again (probe_draws)
    resized: int = 0                      # of them: sized otherwise the second time

    def counts(self) -> dict[tuple, int]:
        return collections.Counter(map(tuple, self.outputs.values()))


def build(models, grammars, drafting: Drafting, slots: int, replica=None):
    """The cell's engine; replica (tp_util.Replica): the target split over its ranks."""
    target, draft = models
    cfg = drafting.config()
    engine = assemble_engine(replica.shard(target) if replica else copy.deepcopy(target),
                             copy.deepcopy(draft) if cfg.uses_draft_model else None, cfg,
                             EngineConfig(max_num_seqs=slots, max_model_len=32), eos=[TINY_EOS], grammars=grammars,
                             tp=replica.tp if replica else None)
    for key, value in COSTS.items():
        setattr(engine.costs, key, value)
    engine.costs.ema = 0.0
    return engine


def probe_draws(engine, record) -> None:
    """The exactness rule's check for adaptive trees (drafting/trees.py): each step, the drafter's
    proposal is drawn again from other generators for the same state and sized by the engine's
    policy; each sampled row's kept size must come out the same (a size that follows the draws makes
    a position's existence depend on its own draw). The drafter's indexes are synced with the
    committed tokens before the proposal, so both proposals read one index state (a sequence admitted
    this step would otherwise join the worker-wide index between them). record(seq, same) counts."""
    propose, sized, policy = engine.drafter.propose, engine.lengths.size_trees, engine.lengths.policy
    tree_sizes, forget, asked, kept = policy.tree_sizes, policy.forget_trees, {}, []
    seeds = itertools.count(1 << 40)                        # the other draws' generators: reruns reproduce

    def proposing(seqs, lengths, generators, guide=None):
        engine.drafter.on_commit(seqs)      # indexes synced first (as every commit does): one state for both
        asked.update(seqs=seqs, lengths=lengths, guide=guide)
        return propose(seqs, lengths, generators, guide)

    def sizing(found):
        kept.clear()
        if found.plans is not None:         # the other draws first, leaving no trace (no forgetting)
            others = [torch.Generator().manual_seed(next(seeds)) for _ in asked["seqs"]]
            policy.forget_trees = lambda *a: None
            sized(propose(asked["seqs"], asked["lengths"], others, asked["guide"]))
            policy.forget_trees = forget
        out = sized(found)
        if len(kept) == 2:
            for seq, other, own in zip(asked["seqs"], *kept):
                if not seq.params.is_greedy:
                    record(seq, other == own)
        return out
    policy.tree_sizes = lambda *args: kept.append(tree_sizes(*args)) or kept[-1]
    engine.drafter.propose, engine.lengths.size_trees = proposing, sizing


def run(engine, plan: dict[Row, int], greedy_prompts) -> dict[Row, RowResult]:
    """Each row kind's requests, queued in turn (rows of every kind side by side); sampled kinds get
    plan[row] requests of PROMPT, greedy ones one per greedy prompt."""
    queues = []
    for row, n in plan.items():
        prompts = greedy_prompts if row.is_greedy else [PROMPT] * n
        queues.append([(f"{row.name}/{i}", list(p), row) for i, p in enumerate(prompts)])
    kind = {}
    for rid, prompt, row in (r for batch in itertools.zip_longest(*queues) for r in batch if r):
        engine.add_request(rid, prompt, row.params(), seed=7)
        kind[rid] = row
    results = {row: RowResult({}) for row in plan}

    def record(seq, same):
        res = results[kind[seq.request_id]]
        res.probed += 1
        res.resized += not same
    if engine.drafting.adaptive and engine.drafting.tree.max_tokens:
        probe_draws(engine, record)
    while engine.has_unfinished():
        out = engine.step()
        for r in out.rounds:
            res = results[kind[r.request_id]]
            res.drafted += r.draft_len - r.forced
            res.accepted += r.accepted - r.forced_accepted
            res.forced += r.forced
            res.trees += r.paths > 1
        for c in out.finished:
            results[kind[c.request_id]].outputs[c.request_id] = c.output_ids
    return results


def run_plan(cell: Cell, cells: list[Cell]) -> dict[Row, int]:
    """The rows of the run that holds `cell`: batch 1, its row kind alone; mixed, every row kind, the
    selected cells' own at N and the others at N_FILLER."""
    if cell.batch == "1":
        return {cell.row: N}
    own = {c.row for c in cells if c.drafting == cell.drafting and c.batch == "mixed"}
    return {row: N if row in own else N_FILLER for row in ROWS}


@pytest.fixture(scope="module")
def cell_results(request, enumerable_models, grammars, greedy_prompts):
    cells, last = selected_cells(request.config.getoption("--matrix")), {}

    def results(cell: Cell) -> dict[Row, RowResult]:
        key = (cell.drafting, cell.batch, cell.row if cell.batch == "1" else None)
        if key not in last:                # one run kept: cells of one run are consecutive
            slots = 1 if cell.batch == "1" else MIXED_SLOTS
            last.clear()
            engine = build(enumerable_models, grammars, cell.drafting, slots)
            last[key] = run(engine, run_plan(cell, cells), greedy_prompts)
        return last[key]
    results.alpha = FAMILY_ALPHA / sum(not c.row.is_greedy for c in cells)
    return results


def check_row(cell: Cell, res: RowResult, reference: Reference, greedy_prompts, alpha: float) -> float | None:
    """The cell's assertions (module docstring); returns its p-value (None: greedy)."""
    d, pvalue = cell.drafting, None
    if cell.row.is_greedy:
        for i, prompt in enumerate(greedy_prompts):
            assert res.outputs[f"{cell.row.name}/{i}"] == reference.greedy(tuple(prompt), cell.row)[0], prompt
        if cell.row.grammar == "regex" and d.forced:
            assert res.forced > 0, "the cell must force tokens"
    else:
        pvalue = binned_pvalue(res.counts(), reference.law(cell.row))
        assert pvalue > alpha, f"{cell.name}: p-value {pvalue:.2e} (level {alpha:.1e})"
        if d.method != "none" and not d.adaptive:     # an adaptive policy may stop drafting what fails
            assert 0 < res.accepted < res.drafted, "the cell must see acceptances and rejections"
    if d.shape == "tree" and d.adaptive and not cell.row.is_greedy:
        assert res.probed > 0 and res.resized == 0, f"{res.resized} of {res.probed} sizes followed the draws"
    if d.method != "none":
        assert res.drafted > 0, "the cell must draft"
    if d.shape == "tree" and not d.adaptive:
        assert res.trees > 0, "the cell must draft trees of more than one path"
    return pvalue


def test_cell(cell, cell_results, reference, greedy_prompts):
    results = cell_results(cell)
    check_row(cell, results[cell.row], reference, greedy_prompts, cell_results.alpha)
    for row, res in results.items():          # fillers beside it: possible outputs only
        if row != cell.row and not row.is_greedy:
            law = reference.law(row)
            assert all(law.get(out, 0.0) > 0 for out in res.counts()), f"{row.name}: an impossible output"


# ---- the same at two ranks ---------------------------------------------------------------------------
# Mixed runs (every row kind beside the cell's) at tensor_parallel_size 2: the draft model's drawn q
# beside the suffix index's under a grammar, adaptive n-gram trees, and penalties with one-hot q. Their
# sampled cells are tested at FAMILY_ALPHA / 3 each: a correct engine fails one with probability at most
# 1e-4; the other row kinds of each run are fillers (possible outputs only), the greedy ones exact.
TP_CELLS = ("hybrid-suffix-q:drawn-lookup:drawn-path-fixed-forced/regex-plain-t07/batch-mixed",
            "ngram-tree-adaptive-forced/free-plain-t1/batch-mixed",
            "hybrid-suffix-q:one-hot-lookup:one-hot-path-adaptive-unforced/regex-penalised-t1/batch-mixed")


@pytest.fixture(scope="module")
def replica(enumerable_models, tmp_path_factory):
    from tp_util import Replica, save_model
    r = Replica(save_model(enumerable_models[0], tmp_path_factory.mktemp("enumerable")), 2)
    yield r
    assert r.close() == [0]


@pytest.mark.parametrize("name", tiers(TP_CELLS, {TP_CELLS[1]}))
def test_cell_at_two_ranks(name, enumerable_models, grammars, reference, greedy_prompts, replica):
    cell = next(c for c in ALL_CELLS if c.name == name)
    tp_cells = [c for c in ALL_CELLS if c.name in TP_CELLS]
    results = run(build(enumerable_models, grammars, cell.drafting, MIXED_SLOTS, replica),
                  run_plan(cell, tp_cells), greedy_prompts)
    check_row(cell, results[cell.row], reference, greedy_prompts, FAMILY_ALPHA / len(TP_CELLS))
    for row, res in results.items():
        if row.is_greedy:
            check_row(Cell(cell.drafting, row, cell.batch), res, reference, greedy_prompts, FAMILY_ALPHA)
        elif row != cell.row:
            law = reference.law(row)
            assert all(law.get(out, 0.0) > 0 for out in res.counts()), f"{row.name}: an impossible output"


# ---- the matrix is the config's space ----------------------------------------------------------------
RAW_KEYS = {
    "method": ["none", "ngram", "suffix", "draft", "hybrid"],
    "hybrid_proposer": ["ngram", "suffix"],
    "draft_sample_method": ["greedy", "probabilistic"],
    "suffix.sample_method": ["probabilistic", "greedy"],
    "tree.max_tokens": [0, 6],
    "tree.sampled": [False, True],
    "adaptive": [False, True],
    "forced_tokens": [True, False],
}


def raw_config(values: dict) -> DraftingConfig:
    return DraftingConfig(method=values["method"], hybrid_proposer=values["hybrid_proposer"],
                          draft_sample_method=values["draft_sample_method"],
                          suffix=SuffixParams(sample_method=values["suffix.sample_method"]),
                          tree=TreeParams(max_tokens=values["tree.max_tokens"], sampled=values["tree.sampled"]),
                          adaptive=values["adaptive"], forced_tokens=values["forced_tokens"])


def test_the_matrix_is_every_combination_the_config_admits():
    """Every value of every drafting key the engine branches on, in every combination: those the
    config admits are the matrix's draftings (keys a method does not read set aside), the others are
    refused, each by a message naming the keys that clash."""
    admitted, refused = set(), 0
    for values in itertools.product(*RAW_KEYS.values()):
        values = dict(zip(RAW_KEYS, values))
        try:
            admitted.add(canonical(raw_config(values)))
        except ConfigError as e:
            refused += 1
            trees = values["tree.max_tokens"] > 0
            assert (trees and values["method"] not in ("ngram", "suffix")) or \
                (values["tree.sampled"] and not (trees and values["method"] == "suffix")), values
            assert "drafting.tree." in str(e) and "drafting.method" in str(e), str(e)
    assert admitted == set(draftings()) and len(admitted) == 60
    assert all(canonical(d.config()) == d for d in draftings())
    assert refused > 0 and len({c.name for c in ALL_CELLS}) == len(ALL_CELLS) == 1440


@pytest.mark.parametrize("overrides, keys", [
    (["drafting.method=hybrid", "models.draft=d", "drafting.tree.max_tokens=8"], ["tree.max_tokens", "method"]),
    (["drafting.method=draft", "models.draft=d", "drafting.tree.max_tokens=8"], ["tree.max_tokens", "method"]),
    (["drafting.method=none", "drafting.tree.max_tokens=8"], ["tree.max_tokens", "method"]),
    (["drafting.method=ngram", "drafting.tree.max_tokens=8", "drafting.tree.sampled=true"],
     ["tree.sampled", "method"]),
    (["drafting.method=suffix", "drafting.tree.sampled=true"], ["tree.sampled", "tree.max_tokens"]),
])
def test_refused_combinations_fail_at_config_load(overrides, keys):
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo.yaml", overrides)
    assert all(f"drafting.{k}" in str(e.value) for k in keys), str(e.value)


def test_the_ci_selection_covers_every_pair_and_every_drafting_triple():
    cells = selected_cells("pairs")
    held = lambda cs: set().union(*(interactions(c.factors(), DRAFTING_FACTORS) for c in cs))
    assert held(cells) == held(ALL_CELLS) and len(cells) < 50
    assert any(c.drafting == Drafting("suffix", lookup_q="drawn", shape="tree", adaptive=True, forced=f)
               for c in cells for f in (True, False))


# ---- mutants: each must fail the cells that exercise it ----------------------------------------------
def cell(drafting: Drafting, row: str, batch: str = "1") -> Cell:
    return Cell(drafting, next(r for r in ROWS if r.name == row), batch)


def assert_caught(c: Cell, models, grammars, reference, match: str, replica=None) -> None:
    """The cell, run alone under the mutant, fails its check at the full product's level."""
    res = run(build(models, grammars, c.drafting, 1 if c.batch == "1" else MIXED_SLOTS, replica), {c.row: N},
              [])[c.row]
    with pytest.raises(AssertionError, match=match):
        check_row(c, res, reference, [], FAMILY_ALPHA / M_FULL)


@pytest.mark.slow
def test_mutant_sizing_adaptive_trees_by_their_draws_is_caught(enumerable_models, grammars, reference, monkeypatch):
    """The bias: sampled trees sized by the estimates of the tokens they drew, not their one-hot twin's."""
    from pipeline.engine.drafting.trees import DraftTree
    monkeypatch.setattr(DraftTree, "plan", property(lambda self: self))
    drafting = Drafting("suffix", lookup_q="drawn", shape="tree", adaptive=True)
    assert_caught(cell(drafting, "free-plain-t1"), enumerable_models, grammars, reference, "sizes followed the draws")


def test_mutant_residual_not_updated_between_siblings_is_caught(enumerable_models, grammars, reference, monkeypatch):
    """A sibling tried against r as it was before the rejected ones, and the final draw from it."""
    from pipeline.engine.core import verify_tree
    monkeypatch.setattr(verify_tree, "_residual", lambda rows, total, q_rows: rows)
    assert_caught(cell(Drafting("suffix", lookup_q="one-hot", shape="tree"), "free-plain-t1"), enumerable_models,
                  grammars, reference, "p-value")


def test_mutant_residual_not_updated_between_siblings_is_caught_at_two_ranks(enumerable_models, grammars, reference,
                                                                             monkeypatch, replica):
    from pipeline.engine.core import verify_tree
    monkeypatch.setattr(verify_tree, "_residual", lambda rows, total, q_rows: rows)
    """The same mutant, its cell's rows 32 at once, over 2 ranks."""
    assert_caught(cell(Drafting("suffix", lookup_q="one-hot", shape="tree"), "free-plain-t1", "mixed"),
                  enumerable_models, grammars, reference, "p-value", replica)


@pytest.mark.slow
def test_mutant_grammar_mask_on_p_but_not_on_dense_q_is_caught(enumerable_models, grammars, reference, monkeypatch):
    """The draft model draws from its q masked by the grammar but reports the unmasked q."""
    from pipeline.engine.core.sampling import bitmask_to_bool
    from pipeline.engine.drafting import draft_model
    row_probs, sample, mask = draft_model.row_probs, draft_model.sample_from_probs, {}

    def unmasked(logits, seqs, extra, argmax_only=False, allowed=None):
        mask["allowed"] = allowed
        return row_probs(logits, seqs, extra, argmax_only)

    def masked_draw(q, uniforms):
        if mask.get("allowed") is not None:
            q = q * bitmask_to_bool(mask["allowed"], q.shape[-1])
            q = q / q.sum(-1, keepdim=True)
        return sample(q, uniforms)
    monkeypatch.setattr(draft_model, "row_probs", unmasked)
    monkeypatch.setattr(draft_model, "sample_from_probs", masked_draw)
    assert_caught(cell(Drafting("draft", draft_q="drawn"), "regex-plain-t1"), enumerable_models, grammars, reference,
                  "p-value")


@pytest.mark.slow
def test_mutant_penalties_on_the_committed_history_only_is_caught(enumerable_models, grammars, reference, monkeypatch):
    """The verifier's p penalised for the committed tokens only, not the candidate prefix before it."""
    row_probs = engine_module.row_probs
    monkeypatch.setattr(engine_module, "row_probs", lambda logits, seqs, extra, *a, **k:
                        row_probs(logits, seqs, [[] for _ in extra], *a, **k))
    assert_caught(cell(Drafting("suffix", lookup_q="drawn"), "free-penalised-t07"), enumerable_models, grammars,
                  reference, "p-value")


@pytest.mark.slow
def test_mutant_draft_length_that_reads_the_drafted_token_is_caught(enumerable_models, grammars, reference,
                                                                    monkeypatch):
    """A draft cut before the first token it drew with q below 0.3 (its length read off the draw)."""
    from pipeline.engine.drafting.draft_model import DraftModelDrafter
    propose = DraftModelDrafter.propose

    def cut(self, seqs, lengths, generators, guide=None):
        found = propose(self, seqs, lengths, generators, guide)
        if found.draft_probs is None:
            return found
        q = found.draft_probs.gather(1, found.draft_ids.unsqueeze(1)).squeeze(1).tolist()
        cu = found.cu_num_draft.tolist()
        keep = [next((i for i in range(n) if q[cu[b] + i] < 0.3), n) for b, n in enumerate(found.num_draft)]
        return found.truncated(keep)
    monkeypatch.setattr(DraftModelDrafter, "propose", cut)
    assert_caught(cell(Drafting("draft", draft_q="drawn"), "free-plain-t1"), enumerable_models, grammars, reference,
                  "p-value")
