"""Live metrics of a generation worker, exported through `ray.util.metrics` (Ray's Prometheus
endpoint on every node: `ray start --metrics-export-port`, scraped at `http://<node>:<port>/metrics`).

Names follow vLLM v1's Prometheus metrics where one has a counterpart, in our own namespace. Ray
prefixes `ray_` on export and counters gain `_total`, as vLLM's do through prometheus_client:

    exported as (ray 2.60)                               kind     extra label      vLLM v1
    ray_specpipe_spec_decode_num_drafts_total            counter                   vllm:spec_decode_num_drafts
    ray_specpipe_spec_decode_num_draft_tokens_total      counter                   vllm:spec_decode_num_draft_tokens
    ray_specpipe_spec_decode_num_accepted_tokens_total   counter                   vllm:spec_decode_num_accepted_tokens
    ray_specpipe_spec_decode_num_accepted_tokens_per_pos_total  counter  position  vllm:spec_decode_num_accepted_tokens_per_pos
    ray_specpipe_generation_tokens_total                 counter                   vllm:generation_tokens
    ray_specpipe_request_success_total                   counter  finished_reason  vllm:request_success
    ray_specpipe_num_requests_running                    gauge                     vllm:num_requests_running
    ray_specpipe_num_requests_waiting                    gauge                     vllm:num_requests_waiting
    ray_specpipe_prefix_cache_queries_total              counter                   vllm:prefix_cache_queries
    ray_specpipe_prefix_cache_hits_total                 counter                   vllm:prefix_cache_hits
    ray_specpipe_rounds_total                            counter                   (none: every round, drafted or not)
    ray_specpipe_forced_tokens_total                     counter                   (none: proposed by a grammar, part of draft tokens)
    ray_specpipe_forced_accepted_tokens_total            counter                   (none: of those, accepted)
    ray_specpipe_structured_rows_total                   counter  valid            (none: rows with a response_format)
    ray_specpipe_generation_tokens_per_s                 gauge                     (none: emitted tokens/s, last ~10 s)
    ray_specpipe_units_committed_total                   counter                   (none)
    ray_specpipe_rows_errored_total                      counter  reason           (none: reason codes of the errors table)

Every series carries `worker` (w0, w0.1 ...) and `run_id`, plus what Ray adds (WorkerId, NodeAddress,
SessionName ...); no per-request label, so cardinality is bounded by workers x draft positions x
finish/error reasons. As in vLLM, a "draft" is a round whose draft was not empty, and per-position
counts are of accepted draft tokens at each draft position (0-based), so they sum to the accepted
tokens. Acceptance rate: rate(accepted_tokens) / rate(draft_tokens).
The prefix-cache pair counts prompt tokens when a row finishes (vLLM counts when it schedules):
the hit rate of engine.prefix_reuse is rate(prefix_cache_hits) / rate(prefix_cache_queries).

Updates cost plain-Python additions per engine step; the Ray metric objects are touched at most
once per `flush_every_s`, and on every unit commit (before the driver hears of it, so a finished
run's counters add up to its output). If Ray's metrics cannot be created or recorded, metrics turn
off with one warning; the job goes on.

Knows Ray's metrics API and the engine's records; knows nothing about units, files or the driver.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

NAMESPACE = "specpipe"
EXPORT_WAIT_MAX_S = 15.0    # the longest a run's end waits for its workers' last metrics report (export_metrics)
TAG_KEYS = ("worker", "run_id")
COUNTERS = {   # name -> (description, extra tag key or None)
    "spec_decode_num_drafts": ("Rounds with a non-empty draft.", None),
    "spec_decode_num_draft_tokens": ("Draft tokens proposed.", None),
    "spec_decode_num_accepted_tokens": ("Draft tokens accepted.", None),
    "spec_decode_num_accepted_tokens_per_pos": ("Draft tokens accepted, by draft position.", "position"),
    "generation_tokens": ("Tokens emitted (committed to outputs).", None),
    "request_success": ("Rows completed, by finish reason.", "finished_reason"),
    "prefix_cache_queries": ("Prompt tokens of finished rows (prefix reuse looked them up).", None),
    "prefix_cache_hits": ("Prompt tokens whose KV was copied from a slot, not computed.", None),
    "rounds": ("Decoding rounds (one per running sequence per engine step).", None),
    "forced_tokens": ("Draft tokens forced by a row's grammar (counted in draft tokens too).", None),
    "forced_accepted_tokens": ("Forced draft tokens accepted.", None),
    "structured_rows": ("Rows with a response_format completed, by whether the grammar ended them.", "valid"),
    "units_committed": ("Units committed.", None),
    "rows_errored": ("Input rows that could not run, by reason.", "reason"),
}
GAUGES = {
    "num_requests_running": "Sequences holding a KV slot.",
    "num_requests_waiting": "Queued sequences without a slot.",
    "generation_tokens_per_s": "Emitted tokens per second over the last few seconds.",
}


@dataclass
class Tally:
    """Counts since the last flush, plus the latest gauges: plain Python, no Ray (unit-testable)."""
    counts: collections.Counter = field(default_factory=collections.Counter)     # (name, tag value) -> n
    running: int = 0
    waiting: int = 0

    def add_step(self, rounds, finished, num_running: int, num_waiting: int) -> None:
        c = self.counts
        for r in rounds:
            c["rounds", None] += 1
            c["generation_tokens", None] += r.emitted
            if r.draft_len:
                c["spec_decode_num_drafts", None] += 1
                c["spec_decode_num_draft_tokens", None] += r.draft_len
                c["spec_decode_num_accepted_tokens", None] += r.accepted
                c["forced_tokens", None] += r.forced
                c["forced_accepted_tokens", None] += r.forced_accepted
                for pos in range(r.accepted):           # the accepted ones lead (a tree: its path's depths)
                    c["spec_decode_num_accepted_tokens_per_pos", str(pos)] += 1
        for done in finished:
            c["request_success", done.finish_reason] += 1
            c["prefix_cache_queries", None] += done.prompt_len
            c["prefix_cache_hits", None] += done.prompt_tokens_reused
            if done.valid is not None:
                c["structured_rows", str(done.valid).lower()] += 1
        self.running, self.waiting = num_running, num_waiting

    def take(self) -> collections.Counter:
        counts, self.counts = self.counts, collections.Counter()
        return counts


class TokenRate:
    """Tokens per second over a sliding window of (time, cumulative tokens) samples."""

    def __init__(self, window_s: float = 10.0):
        self.window_s, self.total = window_s, 0
        self.samples: collections.deque = collections.deque()

    def add(self, now: float, tokens: int) -> float:
        self.total += tokens
        self.samples.append((now, self.total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        (t0, n0) = self.samples[0]
        return (self.total - n0) / (now - t0) if now > t0 else 0.0


class WorkerMetrics:
    """One actor's metrics. Call `on_step`, `on_error_row` from the engine loop, `on_commit` from the
    writer thread (it flushes), `maybe_flush` from the loop when idle. Thread-safe."""

    def __init__(self, worker: str, run_id: str, flush_every_s: float = 1.0, enabled: bool = True):
        self.tags = {"worker": worker, "run_id": run_id}
        self.flush_every_s = flush_every_s
        self.tally, self.rate = Tally(), TokenRate()
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._counters, self._gauges = {}, {}
        self.enabled = enabled and self._create()

    def _create(self) -> bool:
        try:
            from ray.util.metrics import Counter, Gauge
            for name, (doc, extra) in COUNTERS.items():
                keys = TAG_KEYS + ((extra,) if extra else ())
                self._counters[name] = Counter(f"{NAMESPACE}_{name}", doc, keys).set_default_tags(self.tags)
            for name, doc in GAUGES.items():
                self._gauges[name] = Gauge(f"{NAMESPACE}_{name}", doc, TAG_KEYS).set_default_tags(self.tags)
            return True
        except Exception as e:  # noqa: BLE001 -- metrics are optional: never fail the job
            log.warning("live metrics off: could not create Ray metrics: %s: %s", type(e).__name__, e)
            return False

    def on_step(self, out, num_running: int, num_waiting: int) -> None:
        if self.enabled:
            with self._lock:
                self.tally.add_step(out.rounds, out.finished, num_running, num_waiting)
            self.maybe_flush()

    def on_error_row(self, reason: str) -> None:
        if self.enabled:
            with self._lock:
                self.tally.counts["rows_errored", reason] += 1

    def on_commit(self) -> None:
        """A unit is committed: count it and flush everything, before the driver hears of it."""
        if self.enabled:
            with self._lock:
                self.tally.counts["units_committed", None] += 1
            self.flush()

    def maybe_flush(self) -> None:
        if self.enabled and time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            now = time.monotonic()
            self._last_flush = now
            counts = self.tally.take()
            running, waiting = self.tally.running, self.tally.waiting
            try:
                self._record(counts, running, waiting, self.rate.add(now, counts["generation_tokens", None]))
            except Exception as e:  # noqa: BLE001 -- metrics are optional: never fail the job
                self.enabled = False
                log.warning("live metrics off: recording failed: %s: %s", type(e).__name__, e)

    def _record(self, counts: collections.Counter, running: int, waiting: int, tokens_per_s: float) -> None:
        for (name, value), n in counts.items():
            if n > 0:                                   # Ray's Counter.inc refuses 0
                extra = COUNTERS[name][1]
                self._counters[name].inc(n, {extra: value} if extra else None)
        self._gauges["num_requests_running"].set(running)
        self._gauges["num_requests_waiting"].set(waiting)
        self._gauges["generation_tokens_per_s"].set(round(tokens_per_s, 3))
