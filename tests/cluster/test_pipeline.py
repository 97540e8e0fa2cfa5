"""The distributed job on a real local Ray cluster (`ray start --head`, token auth) with a tiny
random-init model (real tokenizer): exactly-once output, consistency of the logs, failure drills,
resume, bad rows."""
import json
import os
import signal
import subprocess
import sys
import time

import datasets
import pytest

from pipeline.cluster.driver import JobFailed, run_job
from pipeline.io.reader import InputError
from pipeline.io.writer import OutputError
from pipeline_util import check_exactly_once, shards, job_config, job_overrides, manifest, prompt_rows, read_run, write_parquet



def test_end_to_end_several_files_and_workers(tiny_model_dir, ray_head, tmp_path):
    ids = shards(tmp_path / "in")
    cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"),
                     f"cluster.address={ray_head.address}")
    summary = run_job(cfg)
    run_dir = tmp_path / "out" / "t"
    run = read_run(run_dir)
    check_exactly_once(run, ids)
    assert not run["errors"]
    # Both workers load and write into one run; which of them commits which unit is timing (a worker
    # that loads late on a busy machine may find the job done): the spread itself is test_dispatch's.
    loaded = {w["worker"] for w in summary["workers"]}
    assert loaded <= {"w0", "w1"} and {c["worker"] for c in run["completions"]} <= loaded
    assert {c["config_hash"] for c in run["completions"]} == {summary["config_hash"]}
    assert summary["rows"] == len(ids) == summary["completions"] and summary["units"] == 6
    assert (run_dir / "_SUCCESS").exists() and not (run_dir / "_staging").exists()
    m = manifest(run_dir)
    ds = datasets.load_dataset("parquet", data_files=m["files"]["completions"], split="train")
    assert sorted(ds["id"]) == sorted(ids) and ds.features["token_ids"].feature.dtype == "int32"
    rounds = datasets.load_dataset("parquet", data_files=str(run_dir / "rounds" / "*.parquet"), split="train")
    assert len(rounds) == len(run["rounds"])
    # rerun: everything is committed, nothing runs, nothing is duplicated
    again = run_job(cfg)
    assert again["units_skipped"] == 6 and again["rows_this_run"] == 0
    assert len(read_run(run_dir)["completions"]) == len(ids)


@pytest.mark.slow
def test_speculation_does_not_change_greedy_output(tiny_model_dir, ray_head, tmp_path):
    """The same job with no draft, n-gram drafts (proposals, mostly rejected on a random model) and a
    draft model (the target itself: every draft accepted) gives identical tokens (fp32 greedy)."""
    rows = [{"id": f"r{i}", "prompt": " ".join(["alpha beta gamma delta"] * (2 + i % 4))} for i in range(10)]
    write_parquet(tmp_path / "in" / "a.parquet", rows)
    out, tokens = {}, {}
    for drafter in ("none", "ngram", "draft"):
        cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / drafter),
                         f"cluster.address={ray_head.address}", f"drafting.method={drafter}",
                         f"models.draft={tiny_model_dir}", "drafting.ngram_min=1",
                         "sampling.max_tokens=24", "drafting.num_speculative_tokens=4", "cluster.num_workers=1")
        out[drafter] = run_job(cfg)
        tokens[drafter] = {c["id"]: c["token_ids"] for c in read_run(tmp_path / drafter / "t")["completions"]}
    assert tokens["ngram"] == tokens["none"] == tokens["draft"] and len(tokens["none"]) == 10
    assert out["ngram"]["draft_tokens"] > 0
    assert out["draft"]["accepted_tokens"] == out["draft"]["draft_tokens"] > 0
    assert out["draft"]["rounds"] < out["none"]["rounds"]


@pytest.mark.slow
def test_worker_killed_mid_unit_job_completes_exactly_once(tiny_model_dir, ray_head, tmp_path):
    ids = shards(tmp_path / "in", files=2, rows=9)
    cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"),
                     f"cluster.address={ray_head.address}", "debug.crash_worker_after_steps=3",
                     "sampling.max_tokens=12", "cluster.num_workers=1")   # only the replacement can finish
    summary = run_job(cfg)
    assert summary["worker_restarts"] >= 1 and summary["unit_retries"] >= 1
    run = read_run(tmp_path / "out" / "t")
    check_exactly_once(run, ids)
    assert any(c["worker"] == "w0.1" for c in run["completions"])       # the replacement worked


@pytest.mark.slow
def test_crash_between_data_and_marker_then_rerun_commits_once(tiny_model_dir, ray_head, tmp_path):
    ids = shards(tmp_path / "in", files=1, rows=8)
    args = (tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"), f"cluster.address={ray_head.address}")
    with pytest.raises(JobFailed, match="no worker left|failed"):
        run_job(job_config(*args, "debug.crash_before_commit=true", "cluster.max_worker_restarts=0"))
    run_dir = tmp_path / "out" / "t"
    assert list((run_dir / "_staging").glob("*/completions.parquet"))    # data was written ...
    assert not (run_dir / "_committed").exists() and not (run_dir / "completions").exists()  # ... unseen
    assert not (run_dir / "_SUCCESS").exists()
    summary = run_job(job_config(*args))
    assert summary["units_skipped"] == 0
    check_exactly_once(read_run(run_dir), ids)


@pytest.mark.slow
def test_driver_killed_then_rerun_skips_committed_units(tiny_model_dir, ray_head, tmp_path):
    ids = shards(tmp_path / "in", files=2, rows=10)
    # two slots: units finish one after another (with every row running at once they all commit within
    # a few ms, and the kill can land after the last one)
    overrides = [f"cluster.address={ray_head.address}", "sampling.max_tokens=24", "input.rows_per_unit=2",
                 "cluster.num_workers=1", "engine.max_num_seqs=2"]
    cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"), *overrides)
    cli = job_overrides(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"), *overrides)  # == cfg
    proc = subprocess.Popen([sys.executable, "jobs/generate.py", *cli], env=os.environ.copy(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    markers = tmp_path / "out" / "t" / "_committed"
    deadline = time.time() + 240
    while time.time() < deadline and len(list(markers.glob("*.json"))) < 2 and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, "the driver finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    committed = len(list(markers.glob("*.json")))
    assert 2 <= committed < 10, f"{committed} of 10 units committed: the driver must die mid-run for this test to mean anything"
    summary = run_job(cfg)
    assert summary["units_skipped"] >= committed
    run = read_run(tmp_path / "out" / "t")
    check_exactly_once(run, ids)
    reference = run_job(job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "ref"), *overrides))
    ref = {c["id"]: c["token_ids"] for c in read_run(tmp_path / "ref" / "t")["completions"]}
    assert {c["id"]: c["token_ids"] for c in run["completions"]} == ref
    assert reference["units_skipped"] == 0


@pytest.mark.slow
def test_bad_rows_become_error_records(tiny_model_dir, ray_head, tmp_path):
    long_prompt = "word " * 400                                        # > max_model_len 256 tokens
    rows = [
        {"id": "ok-1", "prompt": "Tell me about rivers."},
        {"id": "null", "prompt": None},
        {"id": "empty", "prompt": "   "},
        {"id": "int", "prompt": 42},
        {"id": "long", "prompt": long_prompt},
        {"id": "temp", "prompt": "Hi", "temperature": -1.0},
        {"id": "topp", "prompt": "Hi", "top_p": 1.5},
        {"id": "maxtok", "prompt": "Hi", "max_tokens": 0},
        {"id": "seed", "prompt": "Hi", "seed": "abc"},
        {"id": "msgs", "messages": [{"role": "user"}]},
        {"id": "ok-1", "prompt": "a duplicate id"},
        {"id": None, "prompt": "no id"},
        {"id": "ok-2", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    cfg = job_config(tiny_model_dir, str(src), str(tmp_path / "out"), f"cluster.address={ray_head.address}",
                     "input.rows_per_unit=4")
    summary = run_job(cfg)
    run = read_run(tmp_path / "out" / "t")
    assert sorted(c["id"] for c in run["completions"]) == ["ok-1", "ok-2"]
    assert [c["completion_tokens"] for c in run["completions"] if c["id"] == "ok-2"] == [3]
    reasons = {(e["id"], e["reason"], e["field"]) for e in run["errors"]}
    assert reasons == {
        ("null", "empty_prompt", "prompt"), ("empty", "empty_prompt", "prompt"),
        ("int", "bad_prompt_type", "prompt"), ("long", "prompt_too_long", "prompt"),
        ("temp", "bad_sampling", "temperature"), ("topp", "bad_sampling", "top_p"),
        ("maxtok", "bad_sampling", "max_tokens"), ("seed", "bad_sampling", "seed"),
        ("msgs", "bad_messages", "messages"), ("ok-1", "duplicate_id", "id"),
        ("in.jsonl:11", "missing_id", "id"), ("in.jsonl:13", "bad_json", None)}
    assert summary["rows"] == len(rows) + 1 == summary["completions"] + summary["errors"]
    assert all(e["message"] for e in run["errors"])
    assert summary["error_reasons"]["bad_sampling"] == 4


def test_bad_input_and_reused_run_id_fail_before_ray_work(tiny_model_dir, tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", [{"id": "1", "text": "no prompt column"}])
    cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"), "cluster.address=127.0.0.1:1")
    with pytest.raises(InputError, match="found \\['id', 'text'\\]"):
        run_job(cfg)                                  # never reaches the (unreachable) cluster address
    assert not (tmp_path / "out").exists()
    write_parquet(tmp_path / "in" / "a.parquet", prompt_rows(3, "a"))
    (tmp_path / "out" / "t").mkdir(parents=True)
    (tmp_path / "out" / "t" / "_plan.json").write_text(json.dumps({"config_hash": "other", "units": []}))
    with pytest.raises(OutputError, match="another config"):
        run_job(cfg)


@pytest.mark.slow
def test_structured_rows_write_valid_records_and_bad_formats_error_rows(tiny_model_dir, ray_head, tmp_path):
    """Per-row response_format (as a JSON object and as its text) through the real job: valid records
    parsed into `record`, a row cut by max_tokens is not valid, a format that does not compile or
    parse is an error row naming the column, free-text rows are untouched, and the report shows
    validity per kind."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "year"],
              "properties": {"city": {"type": "string", "maxLength": 8}, "year": {"type": "integer",
                                                                                  "minimum": 1000, "maximum": 2999}}}
    rows = [
        {"id": "json", "prompt": "Where and when?", "response_format": {"type": "json_schema", "json_schema": schema}},
        {"id": "json-text", "prompt": "Again?", "response_format": json.dumps({"type": "json_schema",
                                                                                "json_schema": schema})},
        {"id": "choice", "prompt": "Yes or no?", "response_format": {"type": "choice", "choice": ["yes", "no"]}},
        {"id": "short", "prompt": "Cut", "max_tokens": 3, "response_format": {"type": "json_schema",
                                                                              "json_schema": schema}},
        {"id": "regex-bad", "prompt": "Hi", "response_format": {"type": "regex", "regex": "[a-"}},
        {"id": "json-bad", "prompt": "Hi", "response_format": "{not json"},
        {"id": "free", "prompt": "Tell me about rivers."},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = job_config(tiny_model_dir, str(src), str(tmp_path / "out"), f"cluster.address={ray_head.address}",
                     "sampling.max_tokens=60", "input.rows_per_unit=4")
    summary = run_job(cfg)
    run = read_run(tmp_path / "out" / "t")
    done = {c["id"]: c for c in run["completions"]}
    assert sorted(done) == ["choice", "free", "json", "json-text", "short"]
    for rid in ("json", "json-text"):
        c = done[rid]
        if c["finish_reason"] == "eos":
            assert c["valid"] and json.loads(c["record"]) == json.loads(c["text"])
            assert set(json.loads(c["record"])) == {"city", "year"}
        else:
            assert c["valid"] is False and c["record"] is None
        assert c["forced_tokens"] > 0
    assert done["choice"]["valid"] and done["choice"]["text"] in ("yes", "no")
    assert done["short"]["finish_reason"] == "length" and done["short"]["valid"] is False
    assert done["free"]["valid"] is None and done["free"]["response_format"] is None
    assert sum(c["valid"] is True for c in done.values()) >= 2
    errors = {e["id"]: e for e in run["errors"]}
    assert set(errors) == {"regex-bad", "json-bad"}
    assert all(e["reason"] == "bad_response_format" and e["field"] == "response_format" for e in errors.values())
    assert "regex does not compile" in errors["regex-bad"]["message"]
    assert "not valid JSON" in errors["json-bad"]["message"]
    forced = [r for r in run["rounds"] if r["forced"]]
    assert forced and all(r["forced_accepted"] <= r["forced"] for r in forced)
    report = subprocess.run([sys.executable, "-m", "pipeline.report", str(tmp_path / "out" / "t")],
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    assert "structured output per response_format kind" in report.stdout and "json_schema" in report.stdout
    assert summary["error_reasons"]["bad_response_format"] == 2
