"""`engine.max_num_seqs: auto` on CPU (pipeline/engine/model/slots.py, ModelRunner._fit_slots): the knee
from recorded tokens/s curves, and the runner keeping the slots up to it (its store shrunk, the loop
over the new store, greedy output still Hugging Face's), with the memory bound above it."""
from __future__ import annotations

import pytest

from conftest import greedy_reference, mixed_prompts, run_requests, tiny_llama
from pipeline.engine import DraftingConfig, EngineConfig, NgramDrafter, SamplingParams, SpecEngine
from pipeline.engine.backends.cpu import calibrate as cal
from pipeline.engine.backends.flex import capacity
from pipeline.engine.model import slots
from pipeline.engine.model.plan import Kernels
from pipeline.engine.model.runner import ModelRunner

# Recorded: SmolLM2-135M bf16, 2 threads, plain steps at context ~330 (bench.step_bench --sweep), Intel
# Xeon with AMX, the measured linear plan: tokens/s by rows
AMX_BF16 = [(1, 39.9), (2, 70.0), (4, 128.2), (8, 190.0), (16, 260.9), (32, 380.0), (64, 509.0), (128, 540.0),
            (256, 545.0)]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own measurements folder: the rates it fakes are neither read from nor left in the
    machine's kernel cache."""
    monkeypatch.setattr(cal, "plans_folder", lambda: tmp_path)


def test_knee_from_recorded_rates():
    assert slots.knee(AMX_BF16) == 64                   # 509 of the best 545
    assert slots.knee(AMX_BF16, share=0.95) == 128      # 540
    # a flat stretch where the linear plan changes kernel, then a rise: measured past it (both runs
    # of the same machine, one noisier)
    noisy = [(1, 47.0), (2, 86.0), (4, 157.0), (8, 240.0), (16, 259.0), (32, 310.0), (64, 455.0), (128, 518.0),
             (256, 570.0)]
    assert slots.knee(noisy) == 128
    assert slots.knee([(1, 10.0), (2, 19.0), (4, 37.0)]) == 4          # still rising: the last
    assert slots.knee([(1, 10.0), (2, 10.5)]) == 1


def test_probe_limit():
    """Past 64 slots the measured rows end at a multiple of 32, so that starts with a little more or less
    memory free measure the same rows (and read each other's cached rates)."""
    assert [slots.probe_limit(n) for n in (1, 3, 64, 65, 100, 213, 218, 224, 256)] == \
        [1, 3, 64, 64, 96, 192, 192, 224, 256]


def test_probe_rows():
    assert slots.probe_rows(1) == [1]
    assert slots.probe_rows(64) == [1, 2, 4, 8, 16, 32, 64]
    assert slots.probe_rows(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_the_runner_keeps_the_slots_up_to_the_knee(target_model, monkeypatch):
    """A machine whose tokens/s stops rising past 8 rows (the curve given; the rest is the runner's):
    every row count up to the memory bound is timed, the store shrinks to 8 slots, and the engine on
    it still decodes as Hugging Face does."""
    timed, positions = [], []

    def curve(self, rows, context, repeats):
        timed.extend(rows)
        positions.append(self.cache.max_len)
        return [r / {1: 10.0, 2: 19.0, 4: 35.0, 8: 60.0, 16: 62.0}.get(r, 64.0) for r in rows]
    monkeypatch.setattr(ModelRunner, "_step_seconds", curve)
    monkeypatch.setattr(slots, "free_memory", lambda device: 1 << 40)
    runner = ModelRunner(tiny_llama(), EngineConfig(max_num_seqs="auto", max_model_len=1024))
    assert timed == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    fit = (lambda n: capacity(n)) if runner.flex else (lambda n: n)     # FlexAttention's stores hold whole blocks
    assert set(positions) == {fit(385)}                 # measured on a store of context 384 + 1 positions
    assert runner.num_slots == 8 and runner.cache.num_slots == 8 and runner.cache.keys[0].shape[0] == 8
    assert runner.cache.max_len == fit(1024) > fit(385)
    assert runner.decoder is None or runner.decoder.cache is runner.cache
    assert "8, the fewest within 10% of the best" in runner.slots_reason and "KV per sequence" in runner.slots_reason
    engine = SpecEngine(runner, None, EngineConfig(max_num_seqs=8, max_model_len=1024))
    prompts = mixed_prompts(10, 512, seed=4)
    done, _ = run_requests(engine, prompts, SamplingParams(max_tokens=6, temperature=0.0))
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_ids == greedy_reference(target_model, prompt, 6), f"prompt {i}"


def test_memory_bounds_the_measurement(monkeypatch):
    """Memory for 3 slots only: 1, 2 and 3 rows are timed, never more."""
    timed = []
    monkeypatch.setattr(ModelRunner, "_step_seconds", lambda self, rows, c, r: timed.extend(rows) or [0.1] * len(rows))
    model = tiny_llama()
    monkeypatch.setattr(slots, "free_memory", lambda device: 4 * 3 * slots.slot_bytes(model, 256) + 1)
    runner = ModelRunner(model, EngineConfig(max_num_seqs="auto", max_model_len=256))
    assert timed == [1, 2, 3] and runner.num_slots == 3


def test_the_rates_are_measured_once_per_machine_model_and_context(monkeypatch):
    """A second runner of the same model reads the measured rates from the kernel cache (nothing timed,
    the same slots, "cached" in its reason); another context, another model or other kernels are measured."""
    timed = []
    monkeypatch.setattr(ModelRunner, "_step_seconds",
                        lambda self, rows, c, r: timed.extend(rows) or [n / (10.0 * min(n, 4)) for n in rows])
    monkeypatch.setattr(slots, "free_memory", lambda device: 1 << 40)
    first = ModelRunner(tiny_llama(), EngineConfig(max_num_seqs="auto", max_model_len=256))
    assert timed == [1, 2, 4, 8, 16, 32, 64, 128, 256] and first.num_slots == 4
    assert "measured tokens/s" in first.slots_reason
    timed.clear()
    again = ModelRunner(tiny_llama(), EngineConfig(max_num_seqs="auto", max_model_len=256))
    assert timed == [] and again.num_slots == 4 and "cached tokens/s" in again.slots_reason
    ModelRunner(tiny_llama(), EngineConfig(max_num_seqs="auto", max_model_len=512))
    assert timed == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    timed.clear()
    ModelRunner(tiny_llama(layers=3), EngineConfig(max_num_seqs="auto", max_model_len=256))
    assert len(timed) == 9
    timed.clear()
    other = ModelRunner(tiny_llama(), EngineConfig(max_num_seqs="auto", max_model_len=256), Kernels(cpu_linear="off"))
    assert len(timed) == 9 and other.identity()["plan"]["linear"] != first.identity()["plan"]["linear"]
    assert again.identity() == first.identity()           # measured or cached, the same kernels


def test_a_start_with_less_memory_reads_the_rates_up_to_its_bound(monkeypatch, tmp_path):
    """Rates measured to 256 rows serve a later start whose memory bounds it to 100 slots (probe limit
    96): nothing is timed, its count is the knee of the rows up to 96 (64: within 10% of their best).
    On a fresh cache, a start bounded to 64 first, then one with room for 1000: the second measures again
    (the cached rates stop short of its bound), and a third bounded to 100 reads what it measured."""
    timed = []
    rate = {1: 10.0, 2: 19.0, 4: 35.0, 8: 60.0, 16: 80.0, 32: 85.0, 64: 95.0}     # past 64: 200
    monkeypatch.setattr(ModelRunner, "_step_seconds",
                        lambda self, rows, c, r: timed.extend(rows) or [n / rate.get(n, 200.0) for n in rows])
    model = tiny_llama()
    room = {"slots": 0}
    monkeypatch.setattr(slots, "free_memory", lambda device: 4 * room["slots"] * slots.slot_bytes(model, 256) + 1)

    def start(slots_free: int) -> ModelRunner:
        room["slots"] = slots_free
        timed.clear()
        return ModelRunner(tiny_llama(), EngineConfig(max_num_seqs="auto", max_model_len=256))
    assert start(1000).num_slots == 128 and timed == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    bounded = start(100)
    assert timed == [] and bounded.num_slots == 64 and "cached" in bounded.slots_reason
    assert "128:" not in bounded.slots_reason
    monkeypatch.setattr(cal, "plans_folder", lambda: tmp_path / "fresh")
    (tmp_path / "fresh").mkdir()
    assert start(64).num_slots == 64 and timed == [1, 2, 4, 8, 16, 32, 64]
    assert start(1000).num_slots == 128 and timed == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert start(100).num_slots == 64 and timed == []


def test_the_cost_curve_takes_the_measured_plain_steps(monkeypatch):
    """An adaptive engine on an auto runner: its cost curve up to the 8 slots kept is the runner's plain
    steps (their made-up seconds, far below what a forward takes, so a timed one would show), and the
    calibration forwards only the sizes past them, to a full verify step (8 x 5 tokens, below
    LINEAR_FROM); measured again (fresh), every size is timed."""
    fake = {1: 1e-7, 2: 2e-7, 4: 3e-7}          # then 0.5e-7 a row: tokens/s flat from 8 rows on
    monkeypatch.setattr(ModelRunner, "_step_seconds", lambda self, rows, c, r: [fake.get(n, n * 0.5e-7) for n in rows])
    monkeypatch.setattr(slots, "free_memory", lambda device: 1 << 40)
    runner = ModelRunner(tiny_llama(), EngineConfig(max_num_seqs="auto", max_model_len=256))
    assert runner.num_slots == 8 and runner.plain_steps == {**fake, 8: 4e-7}
    engine = SpecEngine(runner, NgramDrafter(), EngineConfig(max_num_seqs="auto", max_model_len=256),
                        drafting=DraftingConfig(method="ngram", adaptive=True))
    forwarded = []
    real = runner.forward
    monkeypatch.setattr(runner, "forward", lambda slots_, starts, tokens, **k:
                        forwarded.append(sum(map(len, tokens))) or real(slots_, starts, tokens, **k))
    engine.calibrate()
    assert engine.costs.verify_curve[:4] == [(1, 1e-7), (2, 2e-7), (4, 3e-7), (8, 4e-7)]
    assert [t for t, _ in engine.costs.verify_curve[4:]] == [16, 32, 40]       # 8 slots x 5 tokens
    assert sorted(set(forwarded)) == [16, 32, 40] and engine.costs_cached is False
    forwarded.clear()
    engine.calibrate(fresh=True)
    assert sorted(set(forwarded)) == [1, 2, 4, 8, 16, 32, 40]
    assert all(s > 1.3e-5 for _, s in engine.costs.verify_curve)     # none of the made-up ones
