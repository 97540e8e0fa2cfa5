"""The CPU linear plan by measurement (pipeline/engine/backends/cpu/calibrate.py): the choice from recorded
timings (machines this project ran on), the rule that a plan is never more than the tolerance slower
than the fastest kernel at any bucket, the memory fallback to one kernel, the cache and its key, the
measuring loop's dropping of a kernel that falls behind, and the runner applying what was chosen."""
from __future__ import annotations

import collections
import functools
import json
import random

import pytest
import torch
from torch import nn

from conftest import tiny_llama
from pipeline.engine.backends.cpu import calibrate as cal
from pipeline.engine.core.timing import interleaved
from pipeline.engine.backends.cpu.linear import LinearPlan, PlannedLinear, can_pack, family
from pipeline.engine.model.runner import build_runner

# Recorded: every linear of SmolLM2-135M, ms per forward, 2 threads (bench/linear_kernels.py --weights smollm2).
AMX_BF16 = {  # Intel Xeon with AMX (amx_bf16, avx512_bf16), bf16
    "torch": {1: 41.3, 4: 39.7, 16: 28.5, 64: 62.6, 256: 158.6},
    "onednn": {1: 29.2, 4: 31.9, 16: 19.1, 64: 45.8, 256: 125.0},
    "panel": {1: 19.9, 4: 21.8, 16: 43.9, 64: 164.7, 256: 610.2}}
AMX_FP32 = {  # the same machine, fp32
    "torch": {1: 30.8, 4: 49.3, 16: 79.0, 64: 139.1, 256: 510.5},
    "onednn": {1: 36.8, 4: 42.0, 16: 59.6, 64: 120.5, 256: 473.4},
    "panel": {1: 36.0, 4: 34.9, 16: 72.7, 64: 228.3, 256: 917.3}}
EPYC_FP32 = {  # AMD EPYC (AVX-512, no AMX), fp32: the panel kernel level with oneDNN up to 64 rows
    "onednn": {1: 62.0, 4: 66.0, 16: 80.0, 64: 150.0, 256: 480.0},
    "panel": {1: 30.0, 4: 33.0, 16: 52.0, 64: 149.0, 256: 585.0}}


def test_choice_from_recorded_timings():
    assert cal.choose_plan(AMX_BF16).describe() == "panel<=4 onednn"
    # fp32 on the same box: F.linear wins 1 row by 15% over the panel kernel, which wins 4 rows by 17%,
    # then oneDNN: three copies of the weights are worth it only where each gains > 5%
    assert cal.choose_plan(AMX_FP32).describe() == "torch<=1 panel<=4 onednn"
    assert cal.choose_plan(EPYC_FP32).describe() == "panel<=16 onednn"   # 64 rows: within 1%, the kernel above


def test_a_kernel_within_tolerance_everywhere_is_not_kept():
    """oneDNN 3% faster at 64 rows only: not worth a second copy of the weights."""
    times = {"panel": {1: 10.0, 16: 20.0, 64: 50.0}, "onednn": {1: 14.0, 16: 25.0, 64: 48.5}}
    assert cal.choose_plan(times) == LinearPlan.single("panel")
    assert cal.choose_plan(times, tolerance=0.01).describe() == "panel<=16 onednn"


def test_an_untimed_bucket_counts_as_a_loss():
    """The panel kernel, dropped after 16 rows while measuring, is never chosen past them."""
    times = {"panel": {1: 10.0, 16: 20.0}, "onednn": {1: 14.0, 16: 55.0, 64: 90.0, 256: 300.0}}
    assert cal.choose_plan(times).describe() == "panel<=16 onednn"


def test_never_slower_than_the_fastest_by_more_than_the_tolerance():
    """Random timings (a fixed seed, so this is one fixed set of 500 cases): at every bucket the plan's
    kernel is within the tolerance of the fastest, and every kernel kept wins somewhere by more."""
    rng = random.Random(7)
    buckets = cal.BUCKETS
    for _ in range(500):
        kinds = rng.sample(["panel", "onednn", "torch"], rng.randint(1, 3))
        times = {k: {b: rng.uniform(0.5, 2.0) * b ** rng.uniform(0.1, 1.0) for b in buckets} for k in kinds}
        plan = cal.choose_plan(times)
        for b in buckets:
            assert times[plan.kind(b)][b] <= (1 + cal.TOLERANCE) * min(t[b] for t in times.values()) + 1e-12
        assert len(plan.kinds) == len(set(plan.kinds))


def test_single_plan_and_the_memory_budget():
    assert cal.single_plan(AMX_BF16) == LinearPlan.single("onednn")
    assert cal.single_plan(EPYC_FP32) == LinearPlan.single("panel")
    c = cal.Calibration("k", {}, "bfloat16", {"qkv": AMX_BF16, "down": EPYC_FP32},
                        {"qkv": cal.choose_plan(AMX_BF16), "down": cal.choose_plan(EPYC_FP32)}, {}, 1.0,
                        family_bytes={"qkv": 100, "down": 50})
    assert c.extra_bytes() == 150
    assert c.within(150) is c
    tight = c.within(149)
    assert tight.single and tight.plans == {"qkv": LinearPlan.single("onednn"), "down": LinearPlan.single("panel")}
    assert "one kernel per family for memory" in tight.describe()


def test_the_panel_and_amx_kernels_share_one_copy():
    """A plan of the panel and AMX kernels reads one copy of the weights (pair panels); adding oneDNN's
    packed copy costs the family's bytes."""
    plans = {"qkv": LinearPlan(((4, "panel"), (32, "amx"))), "down": LinearPlan(((4, "panel"), (32, "amx"), (64, "onednn")))}
    c = cal.Calibration("k", {}, "bfloat16", {}, plans, {}, 1.0, family_bytes={"qkv": 100, "down": 50})
    assert c.extra_bytes() == 50


HOST = {"cpu": "Some CPU", "isa": ["avx2", "fma"], "torch": "2.13.0", "threads": 2}
SHAPES = {"qkv": [(64, 64)] * 4, "lm_head": [(400, 64)]}


def test_the_cache_key_names_everything_the_timings_depend_on():
    base = cal.cache_key(HOST, torch.float32, SHAPES, ("panel", "onednn"))
    assert base == cal.cache_key(dict(HOST), torch.float32, dict(SHAPES), ("panel", "onednn"))
    others = [cal.cache_key(dict(HOST, cpu="Other CPU"), torch.float32, SHAPES, ("panel", "onednn")),
              cal.cache_key(dict(HOST, isa=["avx2", "fma", "amx_bf16"]), torch.float32, SHAPES, ("panel", "onednn")),
              cal.cache_key(dict(HOST, torch="2.14.0"), torch.float32, SHAPES, ("panel", "onednn")),
              cal.cache_key(dict(HOST, threads=4), torch.float32, SHAPES, ("panel", "onednn")),
              cal.cache_key(HOST, torch.bfloat16, SHAPES, ("panel", "onednn")),
              cal.cache_key(HOST, torch.float32, dict(SHAPES, qkv=[(64, 64)] * 5), ("panel", "onednn")),
              cal.cache_key(HOST, torch.float32, dict(SHAPES, lm_head=[(401, 64)]), ("panel", "onednn")),
              cal.cache_key(HOST, torch.float32, SHAPES, ("onednn", "torch")),
              cal.cache_key(HOST, torch.float32, SHAPES, ("panel", "onednn"), "panel_linear-0123456789abcdef"),
              cal.cache_key(HOST, torch.float32, SHAPES, ("panel", "onednn"), None, cal.BUCKETS + (2048,))]
    assert len({base, *others}) == 1 + len(others)


def _weights(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    weights = {f: [torch.randn(o, i, generator=gen).to(dtype) for o, i in s] for f, s in SHAPES.items()}
    return weights


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="oneDNN not available in this torch build")
def test_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    first = cal.calibrate(_weights(), SHAPES, ("onednn", "torch"), None, tmp_path)
    assert not first.cached and set(first.plans) == set(SHAPES)
    for per in first.timings.values():
        assert all(per[k][1] > 0 for k in ("onednn", "torch"))
    files = list(tmp_path.glob("linear-plan-*.json"))
    assert len(files) == 1

    def no_measuring(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(cal, "measure", no_measuring)
    second = cal.calibrate(_weights(), SHAPES, ("onednn", "torch"), None, tmp_path)
    assert second.cached and second.plans == first.plans and second.timings == first.timings
    assert "cached" in second.describe() and "measured in" in first.describe()
    assert second.describe(how=False) == first.describe(how=False)          # what runs, not how it was got
    # a torn or older file is measured again (and rewritten)
    monkeypatch.undo()
    for text in ("{", json.dumps(dict(json.loads(files[0].read_text()), version=cal.VERSION - 1))):
        files[0].write_text(text)
        again = cal.calibrate(_weights(), SHAPES, ("onednn", "torch"), None, tmp_path)
        assert not again.cached
        assert json.loads(files[0].read_text())["version"] == cal.VERSION


class VirtualClock:
    """The measuring loop's clock, advanced only by the fake kernels' stated costs: the timings are
    exactly those costs however busy the machine is."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(cal, "interleaved", functools.partial(interleaved, clock=self))

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def _timed(monkeypatch, costs: dict, kinds: tuple[str, ...]):
    """The real measuring loop over kernels that cost known ms by rows."""
    clock = VirtualClock(monkeypatch)

    def fake(kind, weight, kernel, amx=None):
        return lambda x: clock.spend(costs[kind](x.shape[0]) * 1e-3)
    monkeypatch.setattr(cal, "_runner", fake)
    return cal.measure({"qkv": [torch.zeros(8, 8)]}, kinds, None, repeats=1)["qkv"][0]


def test_measuring_drops_a_kernel_that_falls_behind(monkeypatch):
    """'panel' 0.15 ms per row, 'onednn' 1 ms flat, 'torch' 1.2 ms flat: the panel kernel is timed until it
    is > 2.5x behind and losing ground (16 rows: 2.4 ms, 32 rows: 4.8 ms), not past that, while the
    fastest's time stays flat; the two left at every bucket."""
    costs = {"panel": lambda r: 0.15 * r, "onednn": lambda r: 1.0, "torch": lambda r: 1.2}
    times = _timed(monkeypatch, costs, ("panel", "onednn", "torch"))
    assert sorted(times["onednn"]) == sorted(times["torch"]) == list(cal.BUCKETS)
    assert max(times["panel"]) == 32
    assert cal.choose_plan(times).describe() in ("panel<=4 onednn", "panel<=8 onednn")


def test_where_the_fastest_grows_with_the_rows_one_falling_behind_it_is_dropped_sooner(monkeypatch):
    """'onednn' max(1, 0.1 r) ms grows with the rows from 16 on (1.6 ms, from 1 at 8 rows), where the panel
    kernel (0.2 ms per row) is 2x behind and losing ground: dropped there; oneDNN, left alone, takes
    every larger bucket untimed."""
    costs = {"panel": lambda r: 0.2 * r, "onednn": lambda r: max(1.0, 0.1 * r)}
    times = _timed(monkeypatch, costs, ("panel", "onednn"))
    assert max(times["panel"]) == max(times["onednn"]) == 16
    plan = cal.choose_plan(times)
    assert plan.describe() in ("panel<=4 onednn", "panel<=8 onednn") and plan.kind(2048) == "onednn"


def test_a_kernel_behind_one_still_bound_by_its_weights_is_kept(monkeypatch):
    """The AMX box in bf16: our AMX kernel flat at 3.5 ms to 29 rows, then 0.12 ms per row; oneDNN 1.6x
    behind it and losing ground to 16 rows (5.5 ms + 0.02 per row), then 0.06 ms per row from 137. oneDNN
    is timed at every bucket and takes the many rows; the panel kernel (0.3 ms per row) drops out."""
    costs = {"panel": lambda r: 1.0 + 0.3 * r, "amx": lambda r: max(3.5, 0.12 * r), "onednn": lambda r: max(5.5 + 0.02 * r, 0.06 * r)}
    times = _timed(monkeypatch, costs, ("panel", "amx", "onednn"))
    assert sorted(times["onednn"]) == sorted(times["amx"]) == list(cal.BUCKETS)
    assert max(times["panel"]) <= 32
    plan = cal.choose_plan(times)
    assert plan.kind(16) == "amx" and plan.kind(128) == plan.kind(256) == "onednn"


def test_a_prefill_bucket_is_timed_on_fewer_weights_and_scaled(monkeypatch):
    """Past LARGE_ROWS a bucket's pass runs over the family's first weights up to LARGE_BYTES at LARGE_ROWS
    rows, in proportion fewer past it (here 32 weights of 0.5 MB, 8 MB at 256 rows: 8 weights at 512
    rows, 2 at the prefill step's 2048), and its time is scaled to all of them: each call costs 1 ms
    whatever the rows, so every bucket reads ~32 ms. One timed pass each (repeats 1, no warm-up). The
    LM head is not timed at the prefill step's rows."""
    calls, clock = collections.Counter(), VirtualClock(monkeypatch)

    def fake(kind, weight, kernel, amx=None):
        def run(x):
            calls[x.shape[0]] += 1
            clock.spend(1e-3)
        return run
    monkeypatch.setattr(cal, "_runner", fake)
    monkeypatch.setattr(cal, "LARGE_BYTES", 8 << 20)
    weights = [torch.zeros(256, 512) for _ in range(32)]                        # fp32: 0.5 MB each
    timed = cal.measure({"down": weights, "lm_head": weights[:1]}, ("onednn",), None, buckets=(1, 256, 512),
                        repeats=1, prefill_rows=2048)
    times = timed["down"][0]
    assert calls[256] == 32 + 1 and calls[512] == 8 + 1 and calls[2048] == 2
    assert all(30 < t < 50 for t in times["onednn"].values())
    assert sorted(times["onednn"]) == [1, 256, 512, 2048]
    assert sorted(timed["lm_head"][0]["onednn"]) == [1, 256, 512]      # a prefill step computes no logits


def test_the_runner_applies_the_measured_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPIPE_KERNEL_CACHE", str(tmp_path))
    model = tiny_llama(seed=3)
    names = {name.rpartition(".")[2] for name, m in model.named_modules() if type(m) is nn.Linear}
    runner = build_runner(model, 2, 64)
    calibration = runner.calibration
    assert calibration is not None and not calibration.cached
    planned = {name: m for name, m in runner.model.named_modules() if type(m) is PlannedLinear}
    assert {n.rpartition(".")[2] for n in planned} >= names - {"gate_proj", "up_proj"}
    for name, module in planned.items():
        assert module.plan == calibration.plans[family(name)]
    assert "measured in" in runner.plan.linear
    again = build_runner(tiny_llama(seed=3), 2, 64)
    assert again.calibration.cached and again.calibration.plans == calibration.plans
    assert build_runner(tiny_llama(seed=3), 2, 64, cpu_linear="off").calibration is None


def test_onednn_names_its_implementation():
    if not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN not available in this torch build")
    host = cal.machine()
    name = cal.onednn_implementation(torch.float32)
    assert name is None or isinstance(name, str)
    if "amx_bf16" in host["isa"] and can_pack(torch.device("cpu"), torch.bfloat16):
        assert "amx" in cal.onednn_implementation(torch.bfloat16, 64)
        assert "AMX tiles" in cal.instructions("onednn", torch.bfloat16, host)


def test_workers_starting_together_measure_once(tmp_path, monkeypatch):
    """Two processes calibrating the same key at once (forked, as Ray workers on one machine start):
    one measures, the other waits for its file and reads it."""
    import multiprocessing
    import time
    log = tmp_path / "measured"

    def slow_measure(weights, kinds, kernel, *a, **k):
        with open(log, "a") as f:
            f.write("x")
        time.sleep(0.5)
        # F.linear fastest: the children then run no oneDNN call (no OpenMP pool after the fork)
        times = {kind: {1: 1.0 if kind == "torch" else 2.0} for kind in kinds}
        return {fam: (times, cal.choose_plan(times), {}) for fam in weights}
    monkeypatch.setattr(cal, "measure", slow_measure)

    weights = _weights()

    def work():
        cal.calibrate(weights, SHAPES, ("onednn", "torch"), None, tmp_path / "plans")
    (tmp_path / "plans").mkdir()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=work) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text() == "x"
    assert cal.calibrate(_weights(), SHAPES, ("onednn", "torch"), None, tmp_path / "plans").cached


# Recorded: SmolLM2's attention (9 heads, 3 KV heads, 64 dims), ms, 2 threads, Intel Xeon with AMX: one
# prompt row of 16-512 new tokens from 0, and 64 / n rows of n = 2-8 new tokens at 256 (measure_attention)
AMX_ATTENTION = {"bfloat16": {2: {"kernel": 0.64, "sdpa": 4.44, "amx": 0.47}, 4: {"kernel": 0.69, "sdpa": 2.57, "amx": 0.28},
                              8: {"kernel": 0.63, "sdpa": 1.54, "amx": 0.22}, 16: {"kernel": 0.05, "sdpa": 0.1, "amx": 0.04},
                              64: {"kernel": 0.15, "sdpa": 0.2, "amx": 0.07}, 256: {"kernel": 1.15, "sdpa": 0.68, "amx": 0.29},
                              512: {"kernel": 3.78, "sdpa": 1.99, "amx": 0.81}},
                 "float32": {16: {"kernel": 0.03, "sdpa": 0.05}, 64: {"kernel": 0.090, "sdpa": 0.131},
                             256: {"kernel": 1.04, "sdpa": 1.24}, 512: {"kernel": 3.61, "sdpa": 4.19}}}
WITHOUT_AMX = {n: {k: t[k] for k in ("kernel", "sdpa")} for n, t in AMX_ATTENTION["bfloat16"].items()}


def test_where_rows_leave_our_kernel():
    assert cal.choose_long(AMX_ATTENTION["bfloat16"]) == ("amx", 2)
    assert cal.choose_long(WITHOUT_AMX) == ("sdpa", 256)
    assert cal.choose_long(AMX_ATTENTION["float32"]) == (None, None)
    # faster only at one middle length: not chosen (the longest rows would lose)
    assert cal.choose_long({16: {"kernel": 1, "sdpa": 2}, 64: {"kernel": 2, "sdpa": 1},
                            256: {"kernel": 3, "sdpa": 4}}) == (None, None)
    assert cal.choose_long({64: {"kernel": 1.0, "sdpa": 0.97}, 256: {"kernel": 2.0, "sdpa": 1.0}}) == ("sdpa", 256)
    # both from the same length: the one faster at the longest rows
    assert cal.choose_long({64: {"kernel": 2.0, "sdpa": 1.0, "amx": 1.5},
                            256: {"kernel": 4.0, "sdpa": 1.0, "amx": 2.0}}) == ("sdpa", 64)


@pytest.mark.needs_cc
def test_attention_plan_measured_cached_and_applied(tmp_path, monkeypatch):
    from pipeline.engine.backends.cpu.attention import RowAttention, kernel
    first = cal.calibrate_attention(kernel(), 4, 2, 16, torch.float32, tmp_path)
    assert not first.cached and set(first.timings) == set(cal.ATTENTION_ROWS + cal.STEP_ROWS)
    assert (first.long_kind, first.long_from) == cal.choose_long(first.timings)
    assert first.long_kind != "amx"                           # fp32: not offered
    again = cal.calibrate_attention(kernel(), 4, 2, 16, torch.float32, tmp_path)
    assert again.cached and (again.long_kind, again.long_from) == (first.long_kind, first.long_from)
    # the runner: its attention is the plan's (RowAttention where SDPA takes some rows)
    monkeypatch.setenv("SPECPIPE_KERNEL_CACHE", str(tmp_path / "k"))
    monkeypatch.setattr(cal, "measure_attention", lambda *a, **k: WITHOUT_AMX)
    runner = build_runner(tiny_llama(seed=3), 2, 64)
    assert isinstance(runner.cpu_attention, RowAttention) and runner.cpu_attention.long_from == 256
    assert runner.cpu_attention.long_kind == "sdpa"
    assert "flash attention for rows of >= 256" in runner.plan.attention
    assert not isinstance(build_runner(tiny_llama(seed=3), 2, 64, cpu_attention="on").cpu_attention, RowAttention)


# One SmolLM2 layer's MLP (ms), modules against merged, on the AMX box (bf16 and fp32: ties there) and
# the AMD box's fp32 prefill (bench/RESULTS.md, "CPU kernels": torch's SiLU and multiplies ~2x ours).
MLP_TIMINGS = {"amx-bf16": {64: {"modules": 1.527, "merged": 1.431}, 2048: {"modules": 21.574, "merged": 21.701}},
               "amx-fp32": {64: {"modules": 2.90, "merged": 2.93}, 2048: {"modules": 67.3, "merged": 69.3}},
               "epyc-fp32": {64: {"modules": 3.1, "merged": 2.6}, 2048: {"modules": 95.0, "merged": 70.0}}}


def test_mlp_form_from_recorded_timings():
    """Merged only where it is faster in total and nowhere more than the tolerance slower."""
    assert not cal.choose_merged(MLP_TIMINGS["amx-bf16"])          # 0.1 ms faster at 64, slower at 2048
    assert not cal.choose_merged(MLP_TIMINGS["amx-fp32"])
    assert cal.choose_merged(MLP_TIMINGS["epyc-fp32"])
    assert not cal.choose_merged({64: {"modules": 1.0, "merged": 1.2}, 2048: {"modules": 100.0, "merged": 50.0}})


def test_mlp_plan_measured_cached_and_applied(tmp_path, monkeypatch):
    from pipeline.engine.backends.cpu import fused
    model = tiny_llama(seed=3)
    first = cal.calibrate_mlp(fused.silu_mlps(model)[0], fused.kernel(), tmp_path)
    assert not first.cached and set(first.timings) == set(cal.MLP_ROWS)
    assert first.merged == cal.choose_merged(first.timings)
    again = cal.calibrate_mlp(fused.silu_mlps(model)[0], fused.kernel(), tmp_path)
    assert again.cached and again.merged == first.merged
    for name, merged in (("epyc-fp32", True), ("amx-fp32", False)):
        monkeypatch.setenv("SPECPIPE_KERNEL_CACHE", str(tmp_path / name))      # a machine of each kind
        monkeypatch.setattr(cal, "measure_mlp", lambda *a, _t=MLP_TIMINGS[name], **k: _t)
        runner = build_runner(tiny_llama(seed=3 + merged), 2, 64)
        assert runner.fused_mlps == (2 if merged else 0), name
        assert runner.plan.mlp.startswith("merged" if merged else "modules"), runner.plan.mlp


def test_near_equal_kernels_make_no_extra_switch():
    """oneDNN within 5% of the panel kernel at 1 row, behind at 2-4, ahead from 8: the plan does not
    switch to oneDNN for the one row where noise put it first."""
    times = {"panel": {1: 2.2, 2: 1.4, 4: 1.6, 8: 2.8, 64: 20.0},
             "onednn": {1: 2.15, 2: 1.8, 4: 1.9, 8: 1.9, 64: 3.1}}
    assert cal.choose_plan(times).describe() == "panel<=4 onednn"



def _panel_steps(rows: int) -> float:
    """A panel kernel's ms in steps of 4-row blocks (each block one more pass of arithmetic over the
    streamed weights)."""
    return 4.0 + 0.5 * ((rows + 3) // 4 - 1) * 4


def test_a_switch_moves_to_where_the_two_kernels_cross():
    """Buckets 4 and 8 say panel, then oneDNN (flat 5.2 ms). The panel kernel costs 4 ms to 4 rows and
    6 ms from 5: oneDNN keeps 5-8 rows. Rising smoothly by 0.5 ms per row past 4 instead, it is faster
    to 6 rows: the switch moves there."""
    costs = {"onednn": lambda r: 5.2, "panel": _panel_steps}
    times = {k: {b: costs[k](b) for b in (1, 2, 4, 8, 16)} for k in costs}
    asked = []

    def time_at(rows, pair):
        asked.append((rows, pair))
        return {k: costs[k](rows) for k in pair}
    plan = cal.choose_plan(times)
    assert plan.describe() == "panel<=4 onednn"
    moved, probes = cal.crossings(plan, times, time_at)
    assert moved.describe() == "panel<=4 onednn" and sorted(probes) == [5, 6]
    assert all(4 < rows < 8 and pair == ("panel", "onednn") for rows, pair in asked)

    def smooth(rows):
        return 4.0 + 0.5 * max(0, rows - 4)               # 6 ms at 8 rows
    costs = {"onednn": lambda r: 5.2, "panel": smooth}
    times = {k: {b: costs[k](b) for b in (1, 2, 4, 8, 16)} for k in costs}
    moved, probes = cal.crossings(cal.choose_plan(times), times, time_at)
    assert moved.describe() == "panel<=6 onednn" and cal.choose_plan(times).describe() == "panel<=4 onednn"
    assert moved.kind(6) == "panel" and moved.kind(7) == "onednn" and moved.kind(4096) == "onednn"


def test_a_crossing_far_out_is_found_to_an_eighth_of_the_rows():
    """Three kernels, two switches: panel to 3 rows, AMX to 100, oneDNN past. The second switch lies
    between the 64 and 128 buckets and is found within 8 rows, in 3 probes."""
    costs = {"panel": lambda r: 1.0 + 0.5 * r, "amx": lambda r: 2.0 + 0.1 * r, "onednn": lambda r: 7.0 + 0.05 * r}
    times = {k: {b: costs[k](b) for b in cal.BUCKETS} for k in costs}
    plan = cal.choose_plan(times, tolerance=0.0)
    assert plan.kinds == ("panel", "amx", "onednn")
    moved, probes = cal.crossings(plan, times, lambda rows, pair: {k: costs[k](rows) for k in pair})
    assert moved.kind(2) == "panel" and moved.kind(3) == "amx"        # panel 2.5 vs AMX 2.2 at 3 rows
    last_amx = moved.last_rows("amx")
    assert 92 <= last_amx <= 100 and moved.kind(101) == "onednn"
    assert len([r for r in probes if r > 64]) == 3


def test_measuring_moves_each_switch_to_the_crossing(monkeypatch):
    """The real measuring loop with refine: the panel kernel in 4-row steps, oneDNN flat 5.2 ms to 16
    rows. The plan switches after 4 rows, found by timing 6 and 5 rows."""
    clock = VirtualClock(monkeypatch)

    def fake(kind, weight, kernel, amx=None):
        def run(x):
            rows = x.shape[0]
            clock.spend((_panel_steps(rows) if kind == "panel" else max(5.2, 0.3 * rows)) * 1e-4)
        return run
    monkeypatch.setattr(cal, "_runner", fake)
    times, plan, probes = cal.measure({"qkv": [torch.zeros(8, 8)]}, ("panel", "onednn"), None, repeats=3)["qkv"]
    assert plan.describe() == "panel<=4 onednn" and sorted(probes) == [5, 6]
    assert all(set(p) == {"panel", "onednn"} for p in probes.values())

# One start on a busy machine: both kinds read the scheduler's slices, not the work (16 to 512 tokens).
BUSY = {16: {"kernel": 7.98, "sdpa": 8.01}, 64: {"kernel": 23.99, "sdpa": 24.0},
        256: {"kernel": 23.99, "sdpa": 24.0}, 512: {"kernel": 24.07, "sdpa": 23.97}}
QUIET = {16: {"kernel": 0.05, "sdpa": 0.1}, 64: {"kernel": 0.2, "sdpa": 0.2},
         256: {"kernel": 1.4, "sdpa": 0.8}, 512: {"kernel": 4.8, "sdpa": 1.9}}


def test_timings_that_do_not_grow_with_the_work_are_taken_again_and_never_cached(tmp_path):
    assert cal.disturbed(BUSY) and not cal.disturbed(QUIET)
    runs = iter([BUSY, QUIET])
    timings, busy = cal._undisturbed(lambda: next(runs), "attention plan")
    assert timings == QUIET and not busy
    with pytest.warns(UserWarning, match="not cached"):
        timings, busy = cal._undisturbed(lambda: BUSY, "attention plan")
    assert timings == BUSY and busy
    calls = []

    def measure():
        calls.append(1)
        return "plan", None                       # a disturbed plan: used, not written

    assert cal._cached(tmp_path, "attention-plan", "k", lambda d: "cached", measure) == "plan"
    assert cal._cached(tmp_path, "attention-plan", "k", lambda d: "cached", measure) == "plan"
    assert len(calls) == 2 and not list(tmp_path.glob("*.json"))


@pytest.mark.amx_bf16
def test_amx_attention_plan_applied(tmp_path, monkeypatch):
    """bf16 on a CPU with AMX: the AMX kernel is measured beside the others and, where the plan says so,
    takes the rows from its length on."""
    from pipeline.engine.backends.cpu.attention import RowAttention, amx_kernel, kernel
    plan = cal.calibrate_attention(kernel(), 6, 2, 32, torch.bfloat16, tmp_path, amx=amx_kernel())
    assert all("amx" in t for t in plan.timings.values())
    monkeypatch.setenv("SPECPIPE_KERNEL_CACHE", str(tmp_path / "k"))
    monkeypatch.setattr(cal, "measure_attention", lambda *a, **k: AMX_ATTENTION["bfloat16"])
    runner = build_runner(tiny_llama(seed=3, hidden=128).to(torch.bfloat16), 2, 64)      # head size 32
    assert isinstance(runner.cpu_attention, RowAttention) and runner.cpu_attention.long_kind == "amx"
    assert runner.cpu_attention.long_from == 2 and "our AMX kernel for rows of >= 2" in runner.plan.attention
