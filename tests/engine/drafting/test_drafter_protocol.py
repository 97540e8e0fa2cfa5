"""The engine uses drafters only through the Drafter protocol: a drafter written against the protocol
alone (no base class) runs through SpecEngine losslessly, receives each sequence's own draft
generator, and sees every commit and release; no engine code writes to a drafter's attributes."""
from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest

from conftest import DRAFTERS, make_engine, mixed_prompts, run_requests
from pipeline.engine import DraftingConfig, DraftBatch, Drafter, DraftModelDrafter, EngineConfig, HybridDrafter, NgramDrafter, NoDrafter, SamplingParams, SpecEngine, SuffixDrafter, SuffixParams
from pipeline.engine.model.runner import build_runner

ROOT = Path(__file__).resolve().parents[3]


class ScriptedDrafter:
    """Proposes the next tokens of a fixed script per request (every `corrupt_every`-th one wrong),
    and records what the engine hands it. Implements the protocol structurally: no base class."""
    is_free = True
    draft_runner = None

    def __init__(self, script: dict[str, list[int]], vocab: int, corrupt_every: int = 3):
        self.script, self.vocab, self.corrupt_every = script, vocab, corrupt_every
        self.calls: dict[str, list] = {"prefill": [], "reuse_prefix": [], "propose": [], "on_commit": [],
                                       "release": []}
        self._frozen = True

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"something wrote drafter attribute {name!r}")
        object.__setattr__(self, name, value)

    def _token(self, rid: str, i: int) -> int:
        tok = self.script[rid][i] if i < len(self.script[rid]) else 0
        return (tok + 1) % self.vocab if i % self.corrupt_every == self.corrupt_every - 1 else tok

    def prefill(self, chunks) -> None:
        self.calls["prefill"].append([(seq.request_id, n) for seq, n in chunks])

    def reuse_prefix(self, seq, reuse) -> None:
        self.calls["reuse_prefix"].append((seq.request_id, reuse.num_tokens))

    def catch_up_lag(self, seq) -> int:
        return 0

    def catch_up(self, seqs, lengths, budget):
        return list(lengths), 0

    def propose(self, seqs, lengths, generators) -> DraftBatch:
        self.calls["propose"].append((list(seqs), list(generators)))
        props = [[self._token(s.request_id, len(s.output_ids) + j) for j in range(g)] for s, g in zip(seqs, lengths)]
        return DraftBatch.from_lists(props, "cpu")

    def on_commit(self, seqs) -> None:
        self.calls["on_commit"].append([(s.request_id, len(s.output_ids)) for s in seqs])

    def release(self, seq) -> None:
        self.calls["release"].append(seq.request_id)


def test_every_drafter_satisfies_the_protocol(target_model):
    runner = build_runner(copy.deepcopy(target_model), 2, 64, packed_linear=False)
    drafters = [NoDrafter(), NgramDrafter(), DraftModelDrafter(runner),
                HybridDrafter(NgramDrafter(), DraftModelDrafter(runner)), ScriptedDrafter({}, 8)]
    for drafter in drafters:
        assert isinstance(drafter, Drafter), type(drafter).__name__
    assert [d.is_free for d in drafters] == [True, True, False, False, True]
    assert [d.draft_runner is runner for d in drafters] == [False, False, True, True, False]


def test_a_protocol_only_drafter_runs_through_the_engine_losslessly(target_model):
    prompts = mixed_prompts(6, target_model.config.vocab_size, seed=31)
    params = SamplingParams(max_tokens=12, temperature=0)
    reference, _ = run_requests(make_engine(target_model, "none", max_num_seqs=3, max_model_len=128, g=3),
                                prompts, params)
    script = {rid: c.output_ids for rid, c in reference.items()}
    drafter = ScriptedDrafter(script, target_model.config.vocab_size)
    cfg = EngineConfig(max_num_seqs=3, max_model_len=128, max_prefill_tokens=16)
    engine = SpecEngine(build_runner(copy.deepcopy(target_model), 3, 128, packed_linear=False), drafter, cfg,
                        drafting=DraftingConfig(num_speculative_tokens=3, adaptive=False))
    done, rounds = run_requests(engine, prompts, params, arrive_every=2)
    assert {rid: c.output_ids for rid, c in done.items()} == script
    assert sum(r.accepted for r in rounds) > 0 and sum(r.draft_len - r.accepted for r in rounds) > 0
    # the engine handed it every prompt chunk, each sequence's own draft generator, every commit
    prefilled = {}
    for chunk in drafter.calls["prefill"]:
        for rid, n in chunk:
            prefilled[rid] = prefilled.get(rid, 0) + n
    reused = dict(drafter.calls["reuse_prefix"])                 # once per sequence, before its prefill
    assert len(reused) == len(drafter.calls["reuse_prefix"]) == len(prompts)
    assert reused == {rid: c.prompt_tokens_reused for rid, c in done.items()}
    assert prefilled == {str(i): len(p) - 1 - reused[str(i)] for i, p in enumerate(prompts)
                         if len(p) - 1 - reused[str(i)] > 0}
    for seqs, generators in drafter.calls["propose"]:
        assert all(g is s.rng.draft for s, g in zip(seqs, generators)) and len(seqs) == len(generators)
    assert len(drafter.calls["on_commit"]) == len(drafter.calls["propose"]) == engine.num_steps
    assert sorted(drafter.calls["release"]) == sorted(done)


def drafter_classes() -> set[type]:
    """Every drafter class the package defines: the classes of pipeline/engine/drafting/ with `propose`."""
    found = set()
    for path in (ROOT / "pipeline" / "engine" / "drafting").glob("*.py"):
        module = importlib.import_module(f"pipeline.engine.drafting.{path.stem}")
        found |= {obj for obj in vars(module).values()
                  if isinstance(obj, type) and obj.__module__ == module.__name__ and hasattr(obj, "propose")}
    return found


def parts(drafter) -> list:
    """A drafter and the drafters it holds (a hybrid's two parts)."""
    held = [v for v in vars(drafter).values() if hasattr(v, "propose")]
    return [drafter, *[p for h in held for p in parts(h)]]


@pytest.mark.parametrize("adaptive", [False, True])
def test_engine_never_writes_drafter_attributes(target_model, draft_model, monkeypatch, adaptive):
    """Every drafter class of the package is guarded; every built-in drafter runs, sampled rounds (the
    draft generators in use), eager and lazy draft prefill: after construction, no attribute of any
    drafter is (re)assigned."""
    def refuse(self, name, value):
        raise AttributeError(f"{type(self).__name__}.{name} written after construction")
    guarded = drafter_classes()
    assert {NoDrafter, NgramDrafter, SuffixDrafter, DraftModelDrafter, HybridDrafter} <= guarded
    prompts = mixed_prompts(6, target_model.config.vocab_size, seed=32)
    for kind in DRAFTERS:
        engine = make_engine(target_model, kind, draft_model, max_num_seqs=3, max_model_len=128, g=3,
                             adaptive=adaptive, max_prefill_tokens=16)
        engine.costs.verify_curve, engine.costs.draft_curve = [(1, 1.0), (10_000, 1.0)], [(1, 1e-6), (64, 1e-6)]
        engine.costs.ema = 0.0
        assert {type(d) for d in parts(engine.drafter)} <= guarded, kind
        with monkeypatch.context() as m:
            for cls in guarded:
                m.setattr(cls, "__setattr__", refuse)
            done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=10, temperature=0.9))
        assert len(done) == len(prompts)
        if kind != "none":
            assert sum(r.draft_len for r in rounds) > 0, kind


def test_the_write_guard_fires_for_a_suffix_drafter(target_model, monkeypatch):
    """The guard above can fail for the suffix drafter: one that records its last proposal in an
    attribute is caught."""
    def refuse(self, name, value):
        raise AttributeError(f"{type(self).__name__}.{name} written after construction")

    class Recording(SuffixDrafter):
        def propose(self, seqs, lengths, generators):
            self.last = super().propose(seqs, lengths, generators)
            return self.last

    engine = make_engine(target_model, "none", max_num_seqs=3, max_model_len=128, g=3)
    engine.drafter = Recording(SuffixParams(min_match=1))
    with monkeypatch.context() as m:
        for cls in drafter_classes() | {Recording}:
            m.setattr(cls, "__setattr__", refuse)
        with pytest.raises(AttributeError, match="Recording.last written after construction"):
            run_requests(engine, mixed_prompts(2, target_model.config.vocab_size, seed=3),
                         SamplingParams(max_tokens=4))
