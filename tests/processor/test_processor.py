"""The Ray Data processor (pipeline/processor/): its config, its row contract, and, on a real local Ray
(`ray start --head`, token auth) with the tiny model (real tokenizer), a dataset read from Parquet,
generated and written; bad rows as error rows; the engine kept full across batches; the rounds log
read by the report; a pipeline killed mid-way and rerun with Ray Data's checkpointing writing every
id once."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.engine import SamplingParams
from pipeline.errors import ConfigError
from pipeline.job.rows import RowError, row_request
from pipeline.processor import OUTPUT, SpecpipeProcessorConfig, build_processor
from pipeline.processor.rows import processor_columns
from pipeline_util import prompt_rows, write_parquet

ROOT = Path(__file__).resolve().parents[2]


# ---- config and rows (no Ray) --------------------------------------------------------------------
def test_config_sections_are_the_jobs_dataclasses_from_dicts_too():
    cfg = SpecpipeProcessorConfig(models={"target": "x", "dtype": "float32"}, drafting={"method": "suffix"},
                                  engine={"max_num_seqs": 8}, sampling={"max_tokens": 7, "stop": ["\n"]},
                                  concurrency=(1, 3))
    assert cfg.models.dtype == "float32" and cfg.drafting.method == "suffix" and cfg.engine.max_num_seqs == 8
    assert cfg.sampling == SamplingParams(max_tokens=7, stop=("\n",)) and cfg.concurrency == (1, 3)
    assert SpecpipeProcessorConfig(concurrency=2).concurrency == (2, 2)
    for bad, match in [({"drafting": {"method": "magic"}}, "drafting"), ({"engine": {"max_num_sequences": 3}}, "engine"),
                       ({"sampling": {"temperature": -1}}, "sampling.temperature"), ({"concurrency": (3, 1)}, "concurrency"),
                       ({"concurrency": 0}, "concurrency"), ({"batch_size": 0}, "batch_size"),
                       ({"models": {"device": "cuda"}}, "num_gpus"), ({"drafting": {"method": "draft"}}, "models.draft"),
                       ({"run_id": "a/b"}, "run_id"), ({"models": "smollm2"}, "models")]:
        with pytest.raises(ConfigError, match=match):
            SpecpipeProcessorConfig(**bad)
    with pytest.raises(TypeError, match="unsupported arguments"):
        build_processor(SpecpipeProcessorConfig(), builder_kwargs={})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def processor_row(row: dict, defaults: SamplingParams, tokenizer, id_column: str | None, seed: int):
    return row_request(row, processor_columns(id_column), defaults, seed, tokenizer)


def test_row_contract(tokenizer):
    defaults = SamplingParams(max_tokens=16)
    chat = processor_row({"messages": [{"role": "user", "content": "Hi"}], "sampling_params": {"temperature": 0.5,
                          "top_p": None, "seed": 7}}, defaults, tokenizer, None, 0)
    assert chat.params.temperature == 0.5 and chat.params.max_tokens == 16 and chat.seed == 7
    assert chat.prompt_ids == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                            add_generation_prompt=True, tokenize=True)["input_ids"]
    same = processor_row({"messages": [{"role": "user", "content": "Hi"}],
                          "sampling_params": {"temperature": 0.5, "seed": 7}}, defaults, tokenizer, None, 0)
    assert same.id == chat.id                                      # the content names the sampling stream
    assert processor_row({"prompt": "Hi", "id": 3}, defaults, tokenizer, "id", 0).id == "3"
    fmt = processor_row({"prompt": "Hi", "response_format": {"type": "json_object"}}, defaults, tokenizer, None, 0)
    assert fmt.params.response_format is not None
    for row, reason, field in [
            ({"prompt": "  "}, "empty_prompt", "prompt"), ({}, "empty_prompt", "prompt"),
            ({"prompt": 5}, "bad_prompt_type", "prompt"), ({"messages": [{"role": "user"}]}, "bad_messages", "messages"),
            ({"prompt": "x", "sampling_params": {"n": 2}}, "bad_sampling", "sampling_params.n"),
            ({"prompt": "x", "sampling_params": {"temperature": "hot"}}, "bad_sampling", "sampling_params.temperature"),
            ({"prompt": "x", "sampling_params": {"top_p": 2.0}}, "bad_sampling", "sampling_params.top_p"),
            ({"prompt": "x", "sampling_params": {"seed": -1}}, "bad_sampling", "sampling_params.seed"),
            ({"prompt": "x", "sampling_params": {"ignore_eos": "yes"}}, "bad_sampling", "sampling_params.ignore_eos"),
            ({"prompt": "x", "response_format": {"type": "regex"}}, "bad_response_format", "response_format"),
            ({"prompt": "x", "id": None}, "missing_id", "id")]:
        with pytest.raises(RowError) as e:
            processor_row(row, defaults, tokenizer, "id" if "id" in row else None, 0)
        assert (e.value.reason, e.value.field) == (reason, field), row


# ---- on a real Ray --------------------------------------------------------------------------------
def processor_config(model_dir, **kw) -> SpecpipeProcessorConfig:
    base = dict(models={"target": str(model_dir), "dtype": "float32"},
                drafting={"method": "ngram", "ngram_min": 1, "num_speculative_tokens": 3},
                engine={"max_num_seqs": 8, "max_model_len": 256}, sampling={"max_tokens": 8, "temperature": 0.0},
                batch_size=4, concurrency=1, num_cpus=1, id_column="id")
    return SpecpipeProcessorConfig(**{**base, **kw})


@pytest.fixture
def ray_session(ray_head):
    import ray
    ray.init(address=ray_head.address, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_processor_end_to_end(tiny_model_dir, ray_session, tmp_path):
    """Parquet in -> processor -> Parquet out: every input column kept, the output columns typed as
    OUTPUT (a row-map postprocess lets Ray Data infer them again), bad rows as error rows beside good ones, greedy text equal to the engine's own on the same
    prompts, and the rounds log read back by the report."""
    import ray.data

    from pipeline.job.rows import prompt_ids
    from pipeline.job.runtime import build_engine
    from pipeline.report.summary import load
    rows = prompt_rows(14, "p") + [
        {"id": "bad-empty", "prompt": " "}, {"id": "bad-sampling", "prompt": "Hello", "sampling_params": {"top_p": 3.0}},
        {"id": "bad-long", "prompt": "word " * 400}, {"id": "bad-format", "prompt": "x",
                                                    "response_format": '{"type": "json_schema", "json_schema": 5}'}]
    for r in rows:
        r["extra"] = f"keep-{r['id']}"
        r.setdefault("sampling_params", None)
        r.setdefault("response_format", None)
    write_parquet(tmp_path / "in" / "a.parquet", rows)
    cfg = processor_config(tiny_model_dir, rounds_path=str(tmp_path / "log"), run_id="proc")
    build_processor(cfg)(ray.data.read_parquet(str(tmp_path / "in"))).write_parquet(str(tmp_path / "out"))
    table = pq.read_table(str(tmp_path / "out"))
    out = {r["id"]: r for r in table.to_pylist()}
    assert sorted(out) == sorted(r["id"] for r in rows)
    for name in OUTPUT.names:
        assert table.schema.field(name).type == OUTPUT.field(name).type, name
    assert all(out[r["id"]]["extra"] == r["extra"] for r in rows)
    assert out["bad-empty"]["error"].startswith("empty_prompt: prompt")
    assert out["bad-sampling"]["error"].startswith("bad_sampling: sampling_params.top_p")
    assert out["bad-long"]["error"].startswith("prompt_too_long")
    assert out["bad-format"]["error"].startswith("bad_response_format")
    good = [r for r in rows if not r["id"].startswith("bad")]
    assert all(out[r["id"]]["error"] is None and out[r["id"]]["num_generated_tokens"] == 8 for r in good)
    loaded = build_engine(cfg.models, cfg.drafting, cfg.engine)            # the same engine, here, alone
    for r in good:
        loaded.engine.add_request(r["id"], prompt_ids(loaded.tokenizer, r["prompt"]), cfg.sampling)
    direct = {c.request_id: c for c in loaded.engine.run()}
    assert {i: out[i]["generated_tokens"] for i in direct} == {i: c.output_ids for i, c in direct.items()}
    run = str(tmp_path / "log" / "proc")
    completions, rounds, errors = (load(run, kind).to_pylist() for kind in ("completions", "rounds", "errors"))
    assert sorted(c["id"] for c in completions) == sorted(r["id"] for r in good)
    assert sorted(e["id"] for e in errors) == sorted(r["id"] for r in rows if r["id"].startswith("bad"))
    assert sum(r["emitted"] for r in rounds) == sum(c["completion_tokens"] for c in completions)
    report = subprocess.run([sys.executable, "-m", "pipeline.report", run], capture_output=True, text=True, cwd=ROOT)
    assert report.returncode == 0, report.stderr
    assert "acceptance" in report.stdout


@pytest.mark.slow
def test_engine_stays_full_across_batches(tiny_model_dir, ray_session, tmp_path):
    """Batches of 2 rows, 4 batches held per replica, 8 engine slots: the engine's running batch
    (the rounds' batch_size) goes past one batch's rows; a stage that ran each batch to the end
    alone never would."""
    import ray.data

    from pipeline.report.summary import load
    rows = prompt_rows(24, "q")
    cfg = processor_config(tiny_model_dir, batch_size=2, batches_per_replica=4, rounds_path=str(tmp_path / "log"),
                           run_id="full", sampling={"max_tokens": 16, "temperature": 0.0})
    processor = build_processor(cfg, preprocess=lambda row: {**row, "prompt": row["prompt"] + "!"},
                                postprocess=lambda row: {**row, "chars": len(row["generated_text"])})
    out = processor(ray.data.from_items(rows)).take_all()
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows) and all(r["error"] is None for r in out)
    assert all(r["prompt"].endswith("!") and r["chars"] == len(r["generated_text"]) for r in out)
    sizes = [r["batch_size"] for r in load(str(tmp_path / "log" / "full"), "rounds").to_pylist()]
    assert max(sizes) > 2, sizes


def _output_ids(folder: Path) -> list[str]:
    return [i for f in sorted(glob.glob(str(folder / "*.parquet"))) for i in pq.read_table(f, columns=["id"])["id"].to_pylist()]


@pytest.mark.slow
def test_killed_pipeline_rerun_writes_each_id_once(tiny_model_dir, tmp_path):
    """jobs/ray_data_pipeline.py (read -> processor -> write, Ray Data's checkpointing by id) on the local
    Ray it starts, with 1-CPU replicas, SIGKILLed once 3 output files exist, then rerun with the same
    command: the rerun finishes (its checkpoint filter holds a CPU beside the replica's, and the local
    Ray counts it) and every id is in the output exactly once."""
    rows = prompt_rows(96, "k")
    for i in range(0, 96, 6):
        write_parquet(tmp_path / "in" / f"part-{i:03d}.parquet", rows[i:i + 6], row_group_size=6)
    cmd = [sys.executable, str(ROOT / "jobs" / "ray_data_pipeline.py"), "--input", str(tmp_path / "in"),
           "--output", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "ckpt"), "--id-column", "id",
           "--text-column", "prompt", "--model", str(tiny_model_dir), "--max-tokens", "16", "--batch-size", "2",
           "--blocks", "16", "--cpus-per-replica", "1"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and first.poll() is None and len(glob.glob(str(tmp_path / "out" / "*.parquet"))) < 3:
        time.sleep(0.05)
    assert first.poll() is None, first.stdout.read().decode()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    written = _output_ids(tmp_path / "out")
    assert 0 < len(written) < len(rows), len(written)                # killed mid-way
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    ids = _output_ids(tmp_path / "out")
    assert sorted(ids) == sorted(r["id"] for r in rows), (len(ids), len(set(ids)))


def test_actor_cpus_count_the_checkpoint_filter(tiny_model_dir, monkeypatch):
    """The CPUs the dataset's actors hold: replicas x ranks x num_cpus, plus Ray Data's checkpoint filter
    (one 1-CPU actor) where the DataContext checkpoints."""
    import ray.data
    from ray.data.checkpoint import CheckpointConfig

    from pipeline.processor import actor_cpus
    ctx = ray.data.DataContext.get_current()
    monkeypatch.setattr(ctx, "checkpoint_config", None)
    assert actor_cpus(processor_config(tiny_model_dir, concurrency=(2, 4), num_cpus=1.5)) == 3
    monkeypatch.setattr(ctx, "checkpoint_config", CheckpointConfig(id_column="id", checkpoint_path="/tmp/unused-checkpoint"))
    assert actor_cpus(processor_config(tiny_model_dir, concurrency=(2, 4), num_cpus=1.5)) == 4


@pytest.mark.slow
def test_actors_taking_every_cpu_are_refused(tiny_model_dir, ray_session, monkeypatch):
    """Actors holding all of the cluster's CPUs leave Ray Data's reads none (the dataset would wait
    forever): building the pipeline refuses it, naming num_cpus and the numbers, with Ray Data's
    checkpoint filter counted (lazily: nothing runs here)."""
    import ray.data
    from ray.data.checkpoint import CheckpointConfig
    cpus = ray_session.cluster_resources()["CPU"]
    items = ray.data.from_items([{"prompt": "x"}])
    with pytest.raises(ConfigError, match=rf"num_cpus: .*hold {cpus:g} of the cluster's {cpus:g} CPUs"):
        build_processor(processor_config(tiny_model_dir, num_cpus=cpus))(items)
    build_processor(processor_config(tiny_model_dir, num_cpus=cpus - 1))(items)
    monkeypatch.setattr(ray.data.DataContext.get_current(), "checkpoint_config",
                        CheckpointConfig(id_column="id", checkpoint_path="/tmp/unused-checkpoint"))
    with pytest.raises(ConfigError, match="checkpoint filter"):
        build_processor(processor_config(tiny_model_dir, num_cpus=cpus - 1))(items)
    build_processor(processor_config(tiny_model_dir, num_cpus=cpus - 2))(items)


@pytest.mark.slow
def test_processor_at_two_ranks_writes_the_tokens_of_one(tiny_model_dir, ray_session):
    """models.tensor_parallel_size 2: each replica is 2 ranks (the stage in bundle 0 of its own
    STRICT_PACK placement group, its rank 1 in bundle 1, gloo between them); greedy tokens equal one
    rank's, row for row."""
    import ray.data

    from pipeline.job.rows import prompt_ids
    from pipeline.job.runtime import build_engine
    rows = prompt_rows(10, "t")
    cfg = processor_config(tiny_model_dir, models={"target": str(tiny_model_dir), "dtype": "float32",
                                                   "tensor_parallel_size": 2},
                           sampling={"max_tokens": 12, "temperature": 0.0})
    done = build_processor(cfg)(ray.data.from_items(rows)).take_all()
    assert all(r["error"] is None for r in done)
    one = build_engine(processor_config(tiny_model_dir).models, cfg.drafting, cfg.engine)    # 1 rank, here
    for r in rows:
        one.engine.add_request(r["id"], prompt_ids(one.tokenizer, r["prompt"]), cfg.sampling)
    expected = {c.request_id: c.output_ids for c in one.engine.run()}
    assert {r["id"]: r["generated_tokens"] for r in done} == expected and len(expected) == 10


@pytest.mark.slow
def test_processor_rank_killed_mid_run_every_row_answered_once(tiny_model_dir, ray_head, ray_session):
    """A replica's rank 1 killed (SIGKILL) while rows decode: the replica ends, Ray Data restarts it
    (new ranks in its placement group) and retries its batches; every row comes back once, without error."""
    import threading

    import ray.data
    from ray.util.state import list_actors
    rows = prompt_rows(24, "k")
    cfg = processor_config(tiny_model_dir, models={"target": str(tiny_model_dir), "dtype": "float32",
                                                   "tensor_parallel_size": 2},
                           sampling={"max_tokens": 160, "temperature": 0.0}, batch_size=2)
    killed, errors = [], []
    job = ray_session.get_runtime_context().get_job_id()

    def kill_rank_once():
        deadline = time.time() + 120
        try:
            while time.time() < deadline and not killed:
                alive = list_actors(address=ray_head.dashboard_url,      # this driver's: the head is shared
                                    filters=[("class_name", "=", "RankWorker"), ("state", "=", "ALIVE"),
                                             ("job_id", "=", job)])
                if alive:
                    time.sleep(2)                         # loaded and decoding by then
                    os.kill(alive[0].pid, signal.SIGKILL)
                    killed.append(alive[0].pid)
                time.sleep(0.2)
        except Exception as e:  # noqa: BLE001 -- reported by the assertion below
            errors.append(repr(e))
    killer = threading.Thread(target=kill_rank_once, daemon=True)
    killer.start()
    done = build_processor(cfg)(ray.data.from_items(rows)).take_all()
    killer.join(timeout=5)
    assert killed, f"no rank was killed: {errors}"
    assert sorted(r["id"] for r in done) == sorted(r["id"] for r in rows)
    assert all(r["error"] is None for r in done)


def test_replica_progress_lines_reach_stderr(capfd):
    """A Ray worker's own logging drops INFO: the replica's load and tokens/s lines get a stderr handler
    (which Ray forwards to the driver), once however many replicas a process holds."""
    import logging

    from pipeline.processor import stage
    pkg = logging.getLogger("pipeline.processor")
    saved = (list(pkg.handlers), pkg.level, pkg.propagate)
    pkg.handlers.clear()
    try:
        stage._show_progress()
        stage._show_progress()
        assert len(pkg.handlers) == 1
        stage.log.info("replica-x: 3 rows, 40 tokens")
        assert "replica-x: 3 rows, 40 tokens" in capfd.readouterr().err
    finally:
        pkg.handlers[:] = saved[0]
        pkg.setLevel(saved[1])
        pkg.propagate = saved[2]


def test_engine_thread_reports_each_drain_once(target_model):
    """`on_idle` (the replica's summary line) runs once each time the engine runs out of work, never while
    rows run or wait: five rows through two slots drain once, two rows submitted later drain again."""
    import threading
    from concurrent.futures import wait

    from conftest import make_engine

    from pipeline.job.rows import RowRequest
    from pipeline.processor.stage import EngineThread
    engine = make_engine(target_model, "none", max_num_seqs=2)
    running_at_drain: list[bool] = []
    thread = EngineThread(engine, 1, on_idle=lambda: running_at_drain.append(engine.has_unfinished()))
    params, gate = SamplingParams(max_tokens=6, temperature=0.0), threading.Event()

    def request(i):
        def prepare():
            gate.wait()                      # all five are queued before the engine thread admits any
            return RowRequest(f"r{i}", [1 + i, 2, 3, 4], params, 0)
        return prepare

    def drains(n):
        deadline = time.time() + 10
        while len(running_at_drain) < n and time.time() < deadline:
            time.sleep(0.01)
        return running_at_drain
    first = [thread.submit(request(i)) for i in range(5)]
    gate.set()
    assert all(len(f.result(timeout=60).output_ids) == 6 for f in first)
    assert drains(1) == [False]
    wait([thread.submit(request(i)) for i in range(5, 7)], timeout=60)
    assert drains(2) == [False, False]
    time.sleep(0.2)
    assert running_at_drain == [False, False]


def test_replica_summary_line_says_when_nothing_was_drafted(caplog):
    """The replica's totals: acceptance where it drafted, "nothing drafted" (not an acceptance of 0) where it did not."""
    import logging
    import types

    from pipeline.processor.stage import SpecpipeStage
    stage = object.__new__(SpecpipeStage)
    stage.name, stage._t0 = "replica-x", time.perf_counter() - 2.0
    stats = {"rows": 3, "tokens": 40, "drafted": 0, "accepted": 0, "steps": 12, "step_s": 1.5}
    stage._engine = types.SimpleNamespace(stats=stats)
    with caplog.at_level(logging.INFO, logger="pipeline.processor"):
        stage._log_stats()
        stats.update(drafted=8, accepted=6)
        stage._log_stats()
    first, second = [r.getMessage() for r in caplog.records]
    assert first.startswith("replica-x: 3 rows, 40 tokens, ") and "nothing drafted, 12 steps taking 1.5 of" in first
    assert "acceptance 0.75, 12 steps" in second
