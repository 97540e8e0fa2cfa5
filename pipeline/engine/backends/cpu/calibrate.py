"""The CPU linear plan by measurement: which kernel runs each family of a model's linears at each row
count, timed on the machine the runner is on.

Why: no table of CPU kinds stays true. Our panel kernel streams a weight at memory speed for a few
rows; oneDNN's packed linear blocks for many rows and takes AMX tiles in bf16 where the CPU has
them; torch's F.linear is the fallback. Where one overtakes another depends on the CPU (AVX2 only,
AVX-512 with avx512_bf16, AMX), the dtype, the shapes and the threads: on an AMD EPYC the panel
kernel is level with oneDNN up to 64 rows in fp32; on an Intel Xeon with AMX it loses 3.6x there in
bf16 and wins 1.5x at one row. So a runner times the candidates on its own weights.

The measurement, per family of linears (qkv, o, gate_up, down, lm_head: linear.FAMILIES):
  * the family's real weights, all its layers up to FAMILY_BYTES (so a pass streams from memory as a
    forward does, not from a cache), in each candidate kernel's layout;
  * x of M rows, M in BUCKETS (1 = batch-1 decoding; 5 = verifying 4 draft tokens; 64 x 1 = a step of
    64 sequences) and the engine's prefill step (engine.max_prefill_tokens) past them, for every family
    but the LM head (a prefill step computes no logits); rows past the last bucket take its kernel.
    Buckets past LARGE_ROWS are bound by the arithmetic, not by streaming the weights, and are timed on
    fewer of them (LARGE_BYTES at LARGE_ROWS rows, fewer in proportion past it: the prefill step's on one
    or two);
  * per bucket REPEATS timed passes of each live candidate in turn (interleaved, so drift hits all
    alike), the median kept (it sets aside a first pass's one-off costs); a candidate that is more
    than DROP_RATIO slower than the best and losing ground as rows grow, from DROP_FROM rows on, is
    not timed at larger buckets (a blocked kernel far behind at a few rows, oneDNN's, gains ground as
    rows grow and may still win at many), nor is one more than DROP_BEHIND slower and losing ground
    where the fastest's time has begun to grow with the rows (by GROWTH of their ratio or more: no
    longer bound by streaming its weights, where a kernel behind it may still catch up, as oneDNN does
    with our AMX kernel past 32 rows in bf16); once one candidate is left, the larger buckets are not
    timed (it takes them). The large buckets cost most to time.
`choose_plan` then drops a kernel from the plan wherever the others stay within TOLERANCE of the
fastest at every bucket (each kernel in a plan is a copy of the family's weights), and takes per
bucket the fastest of those kept, or, within TOLERANCE, the kernel of the bucket above (near-equal
timings make no extra switch). `crossings` then moves each switch between two kernels to where they
cross, timing the two at rows between the buckets (halving the gap, to CROSSING_STEP of the rows):
the panel kernel's time rises in steps of its row blocks and oneDNN's does not, so the bucket above
says little about the rows just past a bucket (on the AMX box in fp32, 5 rows, a verify of 4 draft
tokens, ran 1.3x faster on the panel kernel than on oneDNN, which 8 rows had chosen).

The result is cached in the kernel cache folder (build.py), keyed by the CPU (model name and
instruction-set flags, isa.py), torch's version and the instructions its own kernels may use, the
threads, the dtype, the model's linear shapes and the kernels on offer: the next start with the same key reads it in milliseconds. `describe` says what was
chosen per bucket and which instructions each kernel runs on (oneDNN's own implementation name).

This module knows nothing about the engine: it sees weights, kernels and a folder.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ...core.timing import interleaved
from .attention import RowAttention
from .build import cache_dir
from .isa import cpu_flags
from .linear import AMX, FAMILIES, KINDS, LAYOUT, ONEDNN, PANEL_KIND, LinearPlan, PanelKernel

VERSION = 8                              # of the measurement: a change here re-measures every cached plan
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REPEATS = 3
TOLERANCE = 0.10                         # a kernel stays in a plan only where it is >10% faster than the rest
DROP_RATIO, DROP_FROM = 2.5, 16
DROP_BEHIND, GROWTH = 1.5, 0.75
CROSSING_STEP = 0.125                    # where two kernels cross, found to 1/8 of the rows (or one row)
FAMILY_BYTES = 128 << 20
LARGE_ROWS, LARGE_BYTES = 256, 8 << 20
HEAD = "lm_head"                         # the family a prefill step never runs (it computes no logits)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8", "amx_fp16", "asimd", "sve", "bf16")

Timings = dict[str, dict[int, float]]   # kind -> bucket -> ms for the whole family
Probes = dict[int, dict[str, float]]    # rows between two buckets -> kind -> ms (`crossings`)


def _how(cached: bool, seconds: float) -> str:
    return "cached" if cached else f"measured in {seconds:.1f} s"


def _fastest(times: Timings) -> tuple[list[int], dict[int, float]]:
    """The buckets timed (sorted) and each one's fastest time over the kernels."""
    buckets = sorted({b for per in times.values() for b in per})
    return buckets, {b: min(per[b] for per in times.values() if b in per) for b in buckets}


def choose_plan(times: Timings, tolerance: float = TOLERANCE) -> LinearPlan:
    """The plan for one family from its timings: at each bucket the fastest kernel, then the fewest
    kernels that keep every bucket within `tolerance` of its fastest (a kernel dropped is a copy of
    the weights saved). A bucket a kernel was not timed at counts as a loss for it."""
    buckets, best = _fastest(times)
    if not buckets:
        raise ValueError("no timings to choose a plan from")

    def time_of(kind: str, b: int) -> float:
        return times[kind].get(b, math.inf)

    kept = [k for k in KINDS if k in times and any(time_of(k, b) == best[b] for b in buckets)]
    while len(kept) > 1:
        # drop the kernel whose absence costs least, if every bucket stays within tolerance without it
        costs = {}
        for drop in kept:
            rest = [k for k in kept if k != drop]
            worst = max(min(time_of(k, b) for k in rest) / best[b] for b in buckets)
            if worst <= 1 + tolerance:
                costs[drop] = sum(math.log(min(time_of(k, b) for k in rest)) for b in buckets)
        if not costs:
            break
        kept.remove(min(costs, key=costs.get))
    # per bucket the fastest kept kernel, but from the largest bucket down the kernel of the bucket
    # above wherever it is within tolerance too: noise between near-equal kernels makes no extra switches
    chosen, above = {}, None
    for b in reversed(buckets):
        fastest = min(kept, key=lambda k: time_of(k, b))
        chosen[b] = above if above is not None and time_of(above, b) <= (1 + tolerance) * best[b] else fastest
        above = chosen[b]
    segments = []
    for b in buckets:
        kind = chosen[b]
        if segments and segments[-1][1] == kind:
            segments[-1] = (b, kind)
        else:
            segments.append((b, kind))
    return LinearPlan(tuple(segments)) if len(segments) > 1 else LinearPlan.single(segments[0][1])


def single_plan(times: Timings) -> LinearPlan:
    """One kernel for every row count: the one nearest the fastest over the buckets (geometric mean of
    its ratio to each bucket's fastest), for where memory allows one copy of the weights only."""
    buckets, best = _fastest(times)
    score = {k: sum(math.log(per.get(b, math.inf) / best[b]) for b in buckets) for k, per in times.items()}
    return LinearPlan.single(min((k for k in KINDS if k in score), key=score.get))


def machine() -> dict:
    """What the timings depend on besides the model: the CPU, its instruction sets, torch, the threads."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "isa": sorted(cpu_flags() & set(ISA_FLAGS)), "torch": torch.__version__,
            "torch_isa": [torch.backends.cpu.get_cpu_capability(), os.environ.get("ONEDNN_MAX_CPU_ISA", "")],
            "threads": torch.get_num_threads()}


def cache_key(host: dict, dtype: torch.dtype, shapes: dict[str, list[tuple[int, int]]], kinds: tuple[str, ...],
              build: str | None = None, buckets: tuple[int, ...] = BUCKETS) -> str:
    """16 hex digits naming one calibration: machine x dtype x the model's linear shapes x candidates x
    our kernel's build (its source changed: measured again) x the row counts timed."""
    return _digest({"machine": host, "dtype": str(dtype), "kinds": list(kinds), "build": build,
                    "buckets": list(buckets), "shapes": {f: [list(s) for s in shapes[f]] for f in sorted(shapes)}})


def _digest(fields: dict) -> str:
    """16 hex digits of `fields` and the measurement's VERSION."""
    text = json.dumps({"version": VERSION, **fields}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Calibration:
    """The measured plans of one model on this machine."""
    key: str
    machine: dict
    dtype: str
    timings: dict[str, Timings]           # family -> kind -> bucket -> ms (the family's whole weights)
    plans: dict[str, LinearPlan]
    isa: dict[str, str]                   # kind -> the instructions it ran on
    seconds: float                        # how long measuring took (when it was measured)
    cached: bool = False
    single: bool = False                  # one kernel per family (memory allowed no second copy)
    family_bytes: dict[str, int] = field(default_factory=dict)
    crossings: dict[str, Probes] = field(default_factory=dict)    # family -> its crossings' probes

    def extra_bytes(self) -> int:
        """Memory the plans' second (and third) copies of weights take (the panel and AMX kernels share one)."""
        return sum((len({LAYOUT[k] for k in self.plans[f].kinds}) - 1) * self.family_bytes.get(f, 0)
                   for f in self.plans)

    def within(self, budget: int) -> "Calibration":
        """These plans, or one kernel per family where their extra copies exceed `budget` bytes."""
        if self.extra_bytes() <= budget:
            return self
        return replace(self, plans={f: single_plan(t) for f, t in self.timings.items()}, single=True)

    def describe(self, how: bool = True) -> str:
        """The plan per family and each kernel's instructions; how: and whether it was measured (in how
        long) or read from the cache."""
        order = [f for f in FAMILIES if f in self.plans] + sorted(f for f in self.plans if f not in FAMILIES)
        plans = {f: self.plans[f].describe() for f in order}
        if len(set(plans.values())) == 1:
            text = next(iter(plans.values()))
        else:
            text = ", ".join(f"{f}: {p}" for f, p in plans.items())
        used = dict.fromkeys(k for p in self.plans.values() for k in p.kinds)
        isa = "; ".join(f"{k} on {self.isa.get(k, '?')}" for k in used)
        notes = [isa] + ([_how(self.cached, self.seconds)] if how else []) + (
            ["one kernel per family for memory"] if self.single else [])
        return f"{text} ({'; '.join(notes)})"

    def to_json(self) -> dict:
        return {"version": VERSION, "key": self.key, "machine": self.machine, "dtype": self.dtype,
                "seconds": self.seconds, "isa": self.isa, "family_bytes": self.family_bytes,
                "timings": {f: {k: {str(b): ms for b, ms in t.items()} for k, t in per.items()}
                            for f, per in self.timings.items()},
                "plans": {f: [list(s) for s in p.segments] for f, p in self.plans.items()},
                "crossings": {f: {str(n): t for n, t in per.items()} for f, per in self.crossings.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        if data.get("version") != VERSION:
            raise ValueError(f"calibration version {data.get('version')}, expected {VERSION}")
        return cls(data["key"], data["machine"], data["dtype"],
                   {f: {k: {int(b): float(ms) for b, ms in t.items()} for k, t in per.items()}
                    for f, per in data["timings"].items()},
                   {f: LinearPlan(tuple((int(last), kind) for last, kind in segs)) for f, segs in data["plans"].items()},
                   data["isa"], float(data["seconds"]), cached=True, family_bytes=data.get("family_bytes", {}),
                   crossings={f: {int(n): t for n, t in per.items()} for f, per in data.get("crossings", {}).items()})


def _runner(kind: str, weight: torch.Tensor, kernel: PanelKernel | None,
            amx: PanelKernel | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """One weight in `kind`'s layout, as x -> x @ weight.T."""
    n = weight.shape[0]
    if kind in (PANEL_KIND, AMX):
        ours = kernel if kind == PANEL_KIND else amx
        panels = ours.layout(weight)
        return lambda x: ours.unchecked(x, panels, None, n)
    if kind == ONEDNN:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return lambda x: F.linear(x, weight)


def _sample(weights: list[torch.Tensor], limit: int = FAMILY_BYTES) -> list[torch.Tensor]:
    """The first weights of a family up to `limit` bytes (at least one)."""
    taken, size = [], 0
    for w in weights:
        if taken and size + w.numel() * w.element_size() > limit:
            break
        taken.append(w)
        size += w.numel() * w.element_size()
    return taken


class _FamilyTimer:
    """One family's sampled weights in each kernel's layout, timed at any row count up to `most`."""

    def __init__(self, weights: list[torch.Tensor], kinds: tuple[str, ...], kernel: PanelKernel | None,
                 amx: PanelKernel | None, most: int, gen: torch.Generator):
        self.total = len(weights)
        sample = _sample(weights)
        self.sample = sample
        # one input per width: a family's weights may read different widths (an MoE's experts and its
        # shared expert, a name planned as one family in two places)
        self.xs = {w.shape[1]: (torch.randn(most, w.shape[1], generator=gen) * 0.5).to(w.dtype) for w in sample}
        self.fns = {kind: [_runner(kind, w, kernel, amx) for w in sample] for kind in kinds}

    def count(self, rows: int) -> int:
        """The weights a pass of `rows` rows runs over: the whole sample up to LARGE_ROWS rows; past them
        its first weights up to LARGE_BYTES * LARGE_ROWS / rows bytes (at least one), a pass's arithmetic
        staying that of LARGE_BYTES at LARGE_ROWS rows."""
        return len(self.sample) if rows <= LARGE_ROWS else len(_sample(self.sample, LARGE_BYTES * LARGE_ROWS // rows))

    def __call__(self, rows: int, kinds, repeats: int) -> dict[str, float]:
        """kind -> ms of one pass of `rows` rows over all the family's weights, the kinds in turn. No
        warm-up round: the median of `repeats` (3) sets aside a first call's one-off costs (oneDNN's
        kernel for a new row count) as it does a disturbed one."""
        xs, count = [self.xs[w.shape[1]][:rows] for w in self.sample], self.count(rows)
        ms = _interleaved({kind: (lambda fs=self.fns[kind][:count]: [fn(x) for fn, x in zip(fs, xs)]) for kind in kinds},
                          repeats, warmups=0)
        return {kind: t * self.total / count for kind, t in ms.items()}


def _time_buckets(timer: _FamilyTimer, kinds: tuple[str, ...], timed: tuple[int, ...], repeats: int) -> Timings:
    """Each live kind at each bucket, dropping those that fall behind (the module's docstring)."""
    times: Timings = {kind: {} for kind in kinds}
    live, last_ratio, previous = list(kinds), {}, None
    for b in timed:
        for kind, ms in timer(b, live, repeats).items():
            times[kind][b] = ms
        lead = min(live, key=lambda kind: times[kind][b])
        fastest, before = times[lead][b], times[lead].get(previous)
        # the fastest's time grows with the rows (not bound by streaming its weights any more): one
        # falling further behind it does not come back
        growing = before is not None and fastest >= GROWTH * before * b / previous
        for kind in list(live):
            ratio = times[kind][b] / fastest
            behind = ratio > last_ratio.get(kind, math.inf) and (
                ratio > DROP_RATIO or (growing and ratio > DROP_BEHIND))
            if b >= DROP_FROM and behind and len(live) > 1:
                live.remove(kind)
            last_ratio[kind] = ratio
        previous = b
        if len(live) == 1 < len(kinds):
            break              # the others dropped: the one left takes every larger bucket
    return times


def crossings(plan: LinearPlan, times: Timings,
              time_at: Callable[[int, tuple[str, str]], dict[str, float]]) -> tuple[LinearPlan, Probes]:
    """The plan with each switch from one kernel to the next moved to where the two cross: between the
    last bucket of a segment and the next bucket timed, the rows are halved in turn (`time_at(rows,
    (kind, next_kind))` -> kind -> ms), the faster taking the half, until the two ends are adjacent or
    within CROSSING_STEP of each other. Calls between two buckets otherwise take the larger one's kernel:
    5 rows (4 draft tokens and one more) would run oneDNN's blocked kernel at its 8-row cost where the
    panel kernel, still streaming the weights, is faster. (plan, rows -> kind -> ms of the probes)."""
    buckets = sorted({b for per in times.values() for b in per})
    segments, probes = list(plan.segments), {}
    for i in range(len(segments) - 1):
        (low, kind), (_, after) = segments[i], segments[i + 1]
        high = next((b for b in buckets if b > low), None)
        if high is None or kind == after:
            continue
        while high - low > max(1, int(low * CROSSING_STEP)):
            mid = (low + high) // 2
            probes[mid] = time_at(mid, (kind, after))
            low, high = (mid, high) if probes[mid][kind] <= probes[mid][after] else (low, mid)
        segments[i] = (low, kind)
    return LinearPlan(tuple(segments)), probes


def measure(weights: dict[str, list[torch.Tensor]], kinds: tuple[str, ...], kernel: PanelKernel | None,
            buckets: tuple[int, ...] = BUCKETS, repeats: int = REPEATS, amx: PanelKernel | None = None,
            prefill_rows: int | None = None) -> dict[str, tuple[Timings, LinearPlan, Probes]]:
    """family -> (kind -> bucket -> ms of one pass over all the family's weights, timed on a sample of
    them and scaled by count: past LARGE_ROWS rows a smaller one; its plan (choose_plan) moved to where
    its kernels cross (`crossings`), timed while its weights are in their layouts; those probes).
    prefill_rows: one more bucket, for every family but the LM head. One family's layouts alive at a time."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for fam, ws in weights.items():
        timed = tuple(buckets) + ((prefill_rows,) if prefill_rows is not None and fam != HEAD else ())
        timer = _FamilyTimer(ws, kinds, kernel, amx, max(timed), gen)
        times = _time_buckets(timer, kinds, timed, repeats)
        plan, probes = crossings(choose_plan(times), times, lambda rows, pair: timer(rows, pair, repeats))
        out[fam] = (times, plan, probes)
        del timer
    return out


def onednn_implementation(dtype: torch.dtype, rows: int = 64, width: int = 256) -> str | None:
    """The implementation oneDNN runs a packed linear of `rows` rows with (its verbose name, e.g.
    brg_matmul:avx10_1_512_amx), read from its verbose log; None where it says nothing."""
    w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(width, width, dtype=dtype))
    x = torch.zeros(rows, width, dtype=dtype)
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        text = log.read().decode(errors="replace")
    found = re.findall(r"onednn_verbose,(?:v1,)?(?:primitive,)?exec,cpu,inner_product,([^,]+),", text)
    return found[-1] if found else None


def instructions(kind: str, dtype: torch.dtype, host: dict) -> str:
    """The instructions `kind` runs on here, in words."""
    isa = set(host["isa"])
    if kind == AMX:
        return "AMX tiles (amx_bf16)"
    if kind == PANEL_KIND:
        if dtype == torch.bfloat16:
            return "avx512_bf16"
        return "AVX-512 FMA" if "avx512f" in isa else "AVX2 FMA" if {"avx2", "fma"} <= isa else "the compiler's vectors"
    if kind == ONEDNN:
        small, large = onednn_implementation(dtype, 1), onednn_implementation(dtype, 64)
        if large is None:
            return "oneDNN"
        tiles = " (AMX tiles)" if "amx" in large else ""
        return f"{large}{tiles}" if small in (None, large) else f"{small} at 1 row, {large}{tiles} at 64"
    return "torch's F.linear (oneDNN / MKL)"


def plans_folder() -> Path:
    path = cache_dir() / "plans"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def measuring_alone(name: str, folder: Path | None = None):
    """Held by one process of this machine at a time (a lock file in the plans folder): timings taken
    by workers starting together would be each other's noise."""
    with open((folder or plans_folder()) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _cached(folder: Path, name: str, key: str, load: Callable[[dict], object],
            measure: Callable[[], tuple[object, dict]], fresh: bool = False):
    """`load` of the file `name-key.json` in `folder` where this machine wrote one (unless `fresh`), else the
    result of `measure` (result, its JSON), written there; a measurement whose JSON is None is used but not kept.
    Workers starting together on one machine: one measures (timings taken side by side would be each
    other's noise) while the others wait on the lock, then read its file."""
    path = folder / f"{name}-{key}.json"
    with measuring_alone(f"{name}-{key}", folder):
        try:
            if not fresh:
                return load(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):            # none yet, or unreadable: measure
            pass
        result, data = measure()
        if data is None:
            return result
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, path)                 # atomic: a reader on another machine sees a whole file or none
        except OSError:
            pass
        return result


def cached_measurement(name: str, fields: dict, measure: Callable[[], object],
                       folder: Path | None = None, fresh: bool = False) -> tuple[object, bool]:
    """(`measure()`'s JSON-able result, whether it was read from the cache): kept in `folder` (default:
    the kernel cache's plans/) under `fields` and this machine (machine()), so a later start on the
    same machine with the same fields reads it instead of measuring again. fresh: measured now, and
    what later starts read."""
    key = _digest({"machine": machine(), **fields})

    def load(data: dict) -> tuple[object, bool]:
        if data.get("version") != VERSION or data.get("key") != key:
            raise ValueError(f"{name}: another measurement's file")
        return data["value"], True

    def measured() -> tuple[tuple[object, bool], dict]:
        value = measure()
        return (value, False), {"version": VERSION, "key": key, "fields": fields, "value": value}
    return _cached(folder or plans_folder(), name, key, load, measured, fresh)


def _interleaved(calls: dict[str, Callable[[], object]], repeats: int, warmups: int) -> dict[str, float]:
    """Median ms of each named call, the calls taken in turn (core/timing.py), after warm-ups."""
    return {name: t * 1e3 for name, t in zip(calls, interleaved(list(calls.values()), repeats, warmups))}


def disturbed(timings: dict[int, dict[str, float]], least_growth: float = 5.0) -> bool:
    """Whether row timings say the machine was busy elsewhere while they were taken: from the fewest rows
    measured to the most, every kind's work grows many times over (attention's 32x tokens from position
    0: ~1000x the products; an MLP's 32x rows), and quiet measurements grew 14x at the least (torch's
    attention, 16 to 512 tokens; an MLP in bf16, 64 to 2,048 rows). A kind whose time grew less than
    `least_growth` times measured the machine's other load (one start read 8 / 24 / 24 / 24 ms at 16 to
    512 tokens for both kinds)."""
    ns = sorted(timings)
    return len(ns) > 1 and any(timings[ns[-1]][k] < least_growth * timings[ns[0]][k] for k in timings[ns[0]])


def _undisturbed(measure: Callable[[], dict[int, dict[str, float]]], what: str,
                 tries: int = 3, from_rows: int = 0) -> tuple[dict[int, dict[str, float]], bool]:
    """`measure`'s timings, taken again (up to `tries` in all) while they look disturbed (judged on the row
    counts from `from_rows` on); (timings, whether the last still did: such a plan serves this process
    and is not cached)."""
    for _ in range(tries):
        timings = measure()
        if not disturbed({n: t for n, t in timings.items() if n >= from_rows}):
            return timings, False
    warnings.warn(f"{what}: timings did not grow with the work in {tries} tries (the machine is busy); "
                  f"the plan from the last is used and not cached", stacklevel=2)
    return timings, True


def _row_timings(data: dict) -> dict[int, dict[str, float]]:
    """A cached plan's timings by row count, after checking its measurement's VERSION."""
    if data.get("version") != VERSION:
        raise ValueError(f"calibration version {data.get('version')}, expected {VERSION}")
    return {int(n): {k: float(v) for k, v in t.items()} for n, t in data["timings"].items()}


def calibrate(weights: dict[str, list[torch.Tensor]], counts: dict[str, list[tuple[int, int]]],
              kinds: tuple[str, ...], kernel: PanelKernel | None, folder: Path | None = None,
              amx: PanelKernel | None = None, prefill_rows: int | None = None) -> Calibration:
    """The plans for a model whose linears are `counts` (family -> (out, in) of each linear, in order)
    and whose dense weights `weights` holds by family: read from `folder` (default: the kernel cache's
    plans/) where this machine measured the same key, else measured now and written there.
    prefill_rows: the rows of the engine's prefill steps, timed as one more bucket past BUCKETS."""
    if not kinds:
        raise ValueError("no linear kernel to calibrate")
    dtype = next(iter(weights.values()))[0].dtype
    host = machine()
    builds = "+".join(k.build for k in (kernel, amx) if k is not None) or None
    prefill = prefill_rows if prefill_rows is not None and prefill_rows > BUCKETS[-1] else None
    buckets = BUCKETS + ((prefill,) if prefill is not None else ())
    key = cache_key(host, dtype, counts, kinds, builds, buckets)

    def measured() -> tuple[Calibration, dict]:
        t0 = time.perf_counter()
        timed = measure(weights, kinds, kernel, amx=amx, prefill_rows=prefill) if len(kinds) > 1 else {
            f: ({kinds[0]: {BUCKETS[0]: 1.0}}, LinearPlan.single(kinds[0]), {}) for f in weights}
        seconds = time.perf_counter() - t0
        timings = {f: t for f, (t, _, _) in timed.items()}
        plans = {f: plan for f, (_, plan, _) in timed.items()}
        probes = {f: p for f, (_, _, p) in timed.items() if p}
        isa = {k: instructions(k, dtype, host) for k in dict.fromkeys(k for p in plans.values() for k in p.kinds)}
        size = torch.empty(0, dtype=dtype).element_size()
        family_bytes = {f: sum(o * i for o, i in counts[f]) * size for f in counts}
        result = Calibration(key, host, str(dtype).removeprefix("torch."), timings, plans, isa, seconds,
                             family_bytes=family_bytes, crossings=probes)
        return result, result.to_json()
    return _cached(folder or plans_folder(), "linear-plan", key, Calibration.from_json, measured)


ATTENTION_ROWS = (16, 64, 256, 512)     # new tokens of one prompt row, from position 0
STEP_ROWS = (2, 4, 8)                   # new tokens of each of 64 / n verify rows at STEP_CONTEXT
STEP_CONTEXT = 256
LONG_KINDS = ("amx", "sdpa")            # what may take the long rows: our AMX kernel, torch's flash attention


@dataclass
class AttentionPlan:
    """Where rows leave our kernel, as measured: from `long_from` new tokens on, for our AMX kernel or
    torch's flash attention (`long_kind`)."""
    key: str
    timings: dict[int, dict[str, float]]       # new tokens -> {"kernel": ms, "sdpa": ms[, "amx": ms]}
    long_kind: str | None                      # "amx" | "sdpa"; None: ours only
    long_from: int | None
    seconds: float
    cached: bool = False

    def describe(self, how: bool = True) -> str:
        """Where rows leave our kernel; how: as Calibration.describe's."""
        note = f" ({_how(self.cached, self.seconds)})" if how else ""
        if self.long_kind is None:
            return f"cpu-kernel{note}"
        by = "our AMX kernel" if self.long_kind == "amx" else "torch's flash attention"
        return f"cpu-kernel, {by} for rows of >= {self.long_from} new tokens{note}"

    def to_json(self) -> dict:
        return {"version": VERSION, "key": self.key, "seconds": self.seconds, "long_kind": self.long_kind,
                "long_from": self.long_from, "timings": {str(n): t for n, t in self.timings.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "AttentionPlan":
        return cls(data["key"], _row_timings(data), data["long_kind"], data["long_from"], float(data["seconds"]),
                   cached=True)


def choose_long(timings: dict[int, dict[str, float]], tolerance: float = TOLERANCE) -> tuple[str | None, int | None]:
    """(kind, from): for each long kind measured, the fewest new tokens from which it beats our kernel by
    more than `tolerance` at that row length and at every longer one measured; the kind with the fewest
    (ties: the faster at the longest). (None, None) where neither beats ours at the longest."""
    found = []
    for kind in LONG_KINDS:
        if not all(kind in t for t in timings.values()):
            continue
        start = None
        for n in sorted(timings, reverse=True):
            if timings[n][kind] * (1 + tolerance) < timings[n]["kernel"]:
                start = n
            else:
                break
        if start is not None:
            found.append((start, timings[max(timings)][kind], kind))
    if not found:
        return None, None
    start, _, kind = min(found)
    return kind, start


def measure_attention(kernel, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, amx=None,
                      rows: tuple[int, ...] = ATTENTION_ROWS, step_rows: tuple[int, ...] = STEP_ROWS,
                      repeats: int = 5) -> dict[int, dict[str, float]]:
    """ms of one prompt row of n new tokens (from position 0), and of a verify-like step (64 / n rows of
    n new tokens at STEP_CONTEXT) for the step rows, by our kernel, by SDPA and (given) by our AMX
    kernel, interleaved."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(64 // n, n, STEP_CONTEXT) for n in step_rows] + [(1, n, 0) for n in rows]
    cap = max(start + n for _, n, start in shapes)
    slots = max(r for r, _, _ in shapes)
    ks = (torch.randn(slots, kv_heads, cap, dim, generator=gen) * 0.5).to(dtype)
    vs = torch.randn(slots, kv_heads, cap, dim, generator=gen).to(dtype)
    kinds = {"kernel": kernel, "sdpa": RowAttention(kernel, 1)}
    if amx is not None:
        kinds["amx"] = RowAttention(kernel, 1, amx)
    out: dict[int, dict[str, float]] = {}
    for count, n, start in shapes:
        q = torch.randn(count * n, heads, dim, generator=gen).to(dtype)
        table = torch.tensor([list(range(count)), [start] * count, [n] * count, [i * n for i in range(count)]],
                             dtype=torch.long)
        out[n] = _interleaved({name: (lambda fn=fn: fn(q, ks, vs, table, dim ** -0.5)) for name, fn in kinds.items()},
                              repeats, warmups=2)          # SDPA's first calls set up its kernel
    return out


def calibrate_attention(kernel, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                        folder: Path | None = None, amx=None) -> AttentionPlan:
    """Where rows leave our kernel on this machine for this attention shape, and for which (cached like
    the linear plans). amx: our AMX kernel, where the CPU has it (attention.amx_unavailable)."""
    key = _digest({"machine": machine(), "dtype": str(dtype), "heads": heads, "kv_heads": kv_heads, "dim": dim,
                   "build": getattr(kernel, "build", None), "amx": getattr(amx, "build", None)})

    def measured() -> tuple[AttentionPlan, dict]:
        t0 = time.perf_counter()
        timings, busy = _undisturbed(lambda: measure_attention(kernel, heads, kv_heads, dim, dtype, amx),
                                     "attention plan", from_rows=min(ATTENTION_ROWS))
        plan = AttentionPlan(key, timings, *choose_long(timings), time.perf_counter() - t0)
        return plan, None if busy else plan.to_json()
    return _cached(folder or plans_folder(), "attention-plan", key, AttentionPlan.from_json, measured)


MLP_ROWS = (64, 2048)                   # a decoding step's rows at batch, a prefill chunk's tokens


@dataclass
class MlpPlan:
    """Whether the model's SiLU MLPs run merged (gate and up one linear, then our silu_mul in one
    pass: fused.GateUpMLP) or as the model's modules (two linears, torch's silu, torch's multiply)."""
    key: str
    timings: dict[int, dict[str, float]]       # rows -> {"modules": ms, "merged": ms}, one layer's MLP
    merged: bool
    seconds: float
    cached: bool = False

    def describe(self, how: bool = True) -> str:
        """The MLP form; how: as Calibration.describe's."""
        note = f" ({_how(self.cached, self.seconds)})" if how else ""
        return f"{'merged gate/up + silu_mul' if self.merged else 'modules'}{note}"

    def to_json(self) -> dict:
        return {"version": VERSION, "key": self.key, "seconds": self.seconds, "merged": self.merged,
                "timings": {str(n): t for n, t in self.timings.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "MlpPlan":
        return cls(data["key"], _row_timings(data), bool(data["merged"]), float(data["seconds"]), cached=True)


def choose_merged(timings: dict[int, dict[str, float]], tolerance: float = TOLERANCE) -> bool:
    """Merged where it is faster over all the row counts measured and more than `tolerance` slower at none."""
    total = {form: sum(t[form] for t in timings.values()) for form in ("modules", "merged")}
    return total["merged"] < total["modules"] and all(
        t["merged"] <= t["modules"] * (1 + tolerance) for t in timings.values())


def measure_mlp(mlp: torch.nn.Module, ops, rows: tuple[int, ...] = MLP_ROWS,
                repeats: int = REPEATS) -> dict[int, dict[str, float]]:
    """ms of one MLP forward over `rows` tokens as the modules and merged, interleaved."""
    from .fused import GateUpMLP
    merged = GateUpMLP(mlp, ops)
    weight = mlp.gate_proj.weight
    gen = torch.Generator().manual_seed(0)
    out: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, weight.shape[1], generator=gen).to(weight.dtype)
            out[n] = _interleaved({"modules": lambda: mlp(x), "merged": lambda: merged(x)}, repeats, warmups=1)
    return out


def calibrate_mlp(mlp: torch.nn.Module, ops, folder: Path | None = None) -> MlpPlan:
    """The MLP form that runs faster on this machine for this MLP's shape and dtype (cached like the
    linear plans)."""
    weight = mlp.gate_proj.weight
    key = _digest({"machine": machine(), "dtype": str(weight.dtype), "hidden": weight.shape[1],
                   "inter": weight.shape[0], "build": getattr(ops, "build", None)})

    def measured() -> tuple[MlpPlan, dict]:
        t0 = time.perf_counter()
        timings, busy = _undisturbed(lambda: measure_mlp(mlp, ops), "MLP plan")
        plan = MlpPlan(key, timings, choose_merged(timings), time.perf_counter() - t0)
        return plan, None if busy else plan.to_json()
    return _cached(folder or plans_folder(), "mlp-plan", key, MlpPlan.from_json, measured)
