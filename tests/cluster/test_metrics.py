"""Live metrics (pipeline/cluster/metrics.py): the per-step tally without Ray, and a real job on a
dedicated `ray start --head` whose node metrics endpoint is scraped while the job runs and after it
ends; the counters must add up to the run's committed output."""
import collections
import json
import re
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import TOKENIZER_FILES, RayHead, free_port, noisy_copy, tiny_llama
from pipeline.cluster.driver import run_job
from pipeline.cluster.metrics import Tally, TokenRate, WorkerMetrics
from pipeline.job.config import config_hash, load_config
from pipeline_util import job_config, read_run

SERIES = re.compile(r'^(\w+)\{(.*)\} (\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _round(draft_len, mask, emitted, forced=0, forced_accepted=0):
    return SimpleNamespace(draft_len=draft_len, accepted=sum(mask), accepted_mask=mask, emitted=emitted,
                           forced=forced, forced_accepted=forced_accepted)


def test_tally_aggregates_rounds_per_position_and_reasons():
    t = Tally()
    done = lambda reason, reused, valid=None: SimpleNamespace(finish_reason=reason, prompt_len=10,
                                                              prompt_tokens_reused=reused, valid=valid)
    t.add_step([_round(3, [True, True, False], 3, 1, 1), _round(0, [], 1)], [done("stop", 0, True)], 2, 5)
    t.add_step([_round(3, [True, False, False], 2, 2, 1)], [done("length", 9), done("length", 4, False)], 1, 0)
    c = t.take()
    assert (c["rounds", None], c["spec_decode_num_drafts", None]) == (3, 2)      # the empty draft is a round only
    assert (c["spec_decode_num_draft_tokens", None], c["spec_decode_num_accepted_tokens", None]) == (6, 3)
    assert (c["spec_decode_num_accepted_tokens_per_pos", "0"], c["spec_decode_num_accepted_tokens_per_pos", "1"]) == (2, 1)
    assert c["generation_tokens", None] == 6 and (t.running, t.waiting) == (1, 0)
    assert (c["request_success", "stop"], c["request_success", "length"]) == (1, 2)
    assert (c["prefix_cache_queries", None], c["prefix_cache_hits", None]) == (30, 13)
    assert (c["forced_tokens", None], c["forced_accepted_tokens", None]) == (3, 2)
    assert (c["structured_rows", "true"], c["structured_rows", "false"]) == (1, 1)   # free text: not counted
    assert not t.take()                                                           # taking resets the counts


def test_token_rate_is_over_a_sliding_window():
    r = TokenRate(window_s=10)
    assert r.add(0.0, 0) == 0.0
    assert r.add(5.0, 50) == pytest.approx(10.0)
    r.add(10.0, 50)
    assert r.add(20.0, 200) == pytest.approx(20.0)             # samples older than 10 s dropped: 200 / 10 s


def test_disabled_metrics_touch_nothing_and_the_switch_is_not_hashed():
    m = WorkerMetrics("w0", "r", enabled=False)
    m.on_step(SimpleNamespace(rounds=[_round(1, [True], 2)], finished=[]), 1, 0)
    m.on_error_row("bad_json")
    m.on_commit()
    assert not m.tally.counts and not m._counters
    on, off = load_config(None, ["run.metrics=true"]), load_config(None, ["run.metrics=false"])
    assert config_hash(on) == config_hash(off)


def test_unavailable_metrics_turn_off_without_failing(monkeypatch, caplog):
    import ray.util.metrics

    def broken(*args, **kwargs):
        raise RuntimeError("no metrics agent")
    monkeypatch.setattr(ray.util.metrics, "Counter", broken)
    assert not WorkerMetrics("w0", "r").enabled                 # creation failed: off, with a warning
    monkeypatch.undo()
    m = WorkerMetrics("w0", "r", flush_every_s=0)
    assert m.enabled
    monkeypatch.setattr(m, "_record", broken)                   # recording failed: off, the step goes on
    m.on_step(SimpleNamespace(rounds=[_round(1, [True], 2)], finished=[]), 1, 0)
    assert not m.enabled and "live metrics off" in caplog.text


# ---- on a real cluster ------------------------------------------------------------------------------
def scrape(port: int, run_id: str) -> dict:
    """{(metric, frozenset of our labels): value summed over Ray's per-process series} for one run."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out = collections.Counter()
    for line in text.splitlines():
        m = SERIES.match(line)
        if not m or not m.group(1).startswith("ray_specpipe_"):
            continue
        labels = dict(LABEL.findall(m.group(2)))
        if labels.get("run_id") == run_id:
            ours = {k: v for k, v in labels.items() if k in ("worker", "run_id", "position", "reason",
                                                               "finished_reason")}
            out[m.group(1), frozenset(ours.items())] += float(m.group(3))
    return out


def by(series: dict, name: str, label: str | None = None) -> dict:
    """Totals of one metric, keyed by one label's value (None: the grand total)."""
    total = collections.Counter()
    for (metric, labels), value in series.items():
        if metric == name:
            total[dict(labels).get(label) if label else None] += value
    return dict(total)


@pytest.fixture(scope="module")
def metrics_head():
    port = free_port()
    head = RayHead(num_cpus=2, metrics_export_port=port, env={"RAY_metrics_report_interval_ms": "500"})
    head.metrics_port = port
    deadline = time.monotonic() + 60                 # the node's metrics agent comes up after the job API
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                head.stop()
                raise
            time.sleep(0.5)
    yield head
    head.stop()


@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A draft that agrees with tiny_model_dir's target often but not always (partial acceptance:
    n-gram drafts are almost never accepted by a random-init target)."""
    out = tmp_path_factory.mktemp("tiny-draft")
    for name in TOKENIZER_FILES:
        if (tiny_model_dir / name).exists():
            (out / name).write_bytes((tiny_model_dir / name).read_bytes())
    noisy_copy(tiny_llama(vocab=49152, layers=2, hidden=64), noise=0.05).save_pretrained(out)
    return out


def _run(cfg, result: dict) -> None:
    try:
        result["summary"] = run_job(cfg)
    except BaseException as e:  # noqa: BLE001 -- reported by the test
        result["error"] = repr(e)


def _input(path: Path) -> None:
    rows = [{"id": f"m{i}", "prompt": " ".join(["alpha beta gamma delta"] * (2 + i % 4)) + f" {i}"}
            for i in range(48)] + [{"id": "e1", "prompt": "   "}, {"id": "e2", "prompt": "Hi", "temperature": -1.0},
                                   {"id": "e3", "prompt": "Hi", "top_p": 2.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _expected(run: dict, summary: dict) -> dict:
    per_pos = collections.Counter()
    for r in run["rounds"]:
        per_pos.update(str(i) for i, ok in enumerate(r["accepted_mask"]) if ok)
    c = run["completions"]
    expected = {
        "ray_specpipe_spec_decode_num_draft_tokens_total": {None: sum(x["draft_tokens"] for x in c)},
        "ray_specpipe_spec_decode_num_accepted_tokens_total": {None: sum(x["accepted_tokens"] for x in c)},
        "ray_specpipe_spec_decode_num_drafts_total": {None: sum(1 for r in run["rounds"] if r["draft_len"])},
        "ray_specpipe_rounds_total": {None: len(run["rounds"])},
        "ray_specpipe_generation_tokens_total": {None: sum(x["completion_tokens"] for x in c)},
        "ray_specpipe_units_committed_total": {None: summary["units"]},
        "ray_specpipe_spec_decode_num_accepted_tokens_per_pos_total": dict(per_pos),
        "ray_specpipe_rows_errored_total": dict(collections.Counter(e["reason"] for e in run["errors"])),
        "ray_specpipe_request_success_total": dict(collections.Counter(x["finish_reason"] for x in c)),
        "ray_specpipe_prefix_cache_queries_total": {None: sum(x["prompt_tokens"] for x in c)},
        "ray_specpipe_prefix_cache_hits_total": {None: summary["prompt_tokens_reused"]},
    }
    # a Ray counter exists from its first increment (Ray refuses inc(0)): zeros are absent series
    return {name: {k: v for k, v in values.items() if v} for name, values in expected.items()}


LABELS = {"ray_specpipe_spec_decode_num_accepted_tokens_per_pos_total": "position",
          "ray_specpipe_rows_errored_total": "reason", "ray_specpipe_request_success_total": "finished_reason"}


def _totals(series: dict, expected: dict) -> dict:
    return {name: {k: int(v) for k, v in by(series, name, LABELS.get(name)).items()} for name in expected}


@pytest.mark.slow
def test_live_metrics_scraped_during_and_after_a_job(tiny_model_dir, noisy_draft_dir, metrics_head, tmp_path):
    """The series must show while the job runs: a worker flushes at most once a second and the node
    exports every 0.5 s, so the first scrape that can see them comes ~1.5 s after generation starts.
    48 rows x 48 tokens keep the one worker generating ~6 s here (24 x 24 took 1.7 s and was seen
    too late in 1 of 2 runs)."""
    src = tmp_path / "in.jsonl"
    _input(src)
    run_id, port = "live", metrics_head.metrics_port
    cfg = job_config(tiny_model_dir, str(src), str(tmp_path / "out"), f"cluster.address={metrics_head.address}",
                     f"run.run_id={run_id}", "sampling.max_tokens=48", "drafting.method=draft",
                     f"models.draft={noisy_draft_dir}", "cluster.num_workers=1")
    result: dict = {}
    job = threading.Thread(target=_run, args=(cfg, result), name="job", daemon=True)
    t0 = time.monotonic()
    job.start()
    live, t_live = {}, float("nan")
    while job.is_alive() and time.monotonic() - t0 < 120:
        series = scrape(port, run_id)
        if by(series, "ray_specpipe_generation_tokens_total") and job.is_alive():
            live, t_live = series, time.monotonic()     # the run's counters, read while it runs
            break
        time.sleep(0.3)
    job.join(timeout=120)
    assert not job.is_alive() and "error" not in result, result.get("error")
    print(f"job {time.monotonic() - t0:.1f} s, generating {result['summary'].get('generate_s')} s, "
          f"live after {t_live - t0:.1f} s")
    assert live, "no metric of the run was scraped while it ran"
    gauges = {name for name, _ in live}
    assert {"ray_specpipe_num_requests_running", "ray_specpipe_num_requests_waiting",
            "ray_specpipe_generation_tokens_per_s"} <= gauges, sorted(gauges)

    run_dir = tmp_path / "out" / run_id
    run, summary = read_run(run_dir), result["summary"]
    expected = _expected(run, summary)
    accepted = expected["ray_specpipe_spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted[None] < expected["ray_specpipe_spec_decode_num_draft_tokens_total"][None]
    assert len(expected["ray_specpipe_rows_errored_total"]) == 2
    # the rows repeat "alpha beta gamma delta": prefix reuse copies some of their prompt KV
    assert summary["prompt_tokens"] == expected["ray_specpipe_prefix_cache_queries_total"][None]
    assert 0 < summary["prompt_tokens_reused"] < summary["prompt_tokens"]
    deadline, got = time.monotonic() + 15, None
    while time.monotonic() < deadline:                   # the export lags by the report interval
        got = _totals(scrape(port, run_id), expected)
        if got == expected:
            break
        time.sleep(0.5)
    assert got == expected
    per_pos = got["ray_specpipe_spec_decode_num_accepted_tokens_per_pos_total"]
    assert sum(per_pos.values()) == got["ray_specpipe_spec_decode_num_accepted_tokens_total"][None]
    assert {dict(labels)["worker"] for _, labels in scrape(port, run_id)} == {"w0"}
