"""The Ray generation job reading its input from and writing its output to s3:// on a real S3 protocol
server on loopback (moto's ThreadedMotoServer: HTTP, SigV4, list/put/copy/delete as AWS does them).

Everything the job does to the store goes over HTTP from three kinds of processes: the driver (this
pytest process), and the worker actors on the `ray start --head` cluster, which see the endpoint and
keys only through the pickled config (the environment test sets AWS_* only after the head started).
The checks read the output back with a separate, uncached s3fs instance and with `datasets`
(which reaches moto through s3fs with the same storage_options).
"""
from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cluster import driver
from pipeline.cluster.driver import run_job
from pipeline.io.reader import InputError
from pipeline_util import job_config, prompt_rows
from s3_util import AWS_VARS, BUCKET, KEY, REGION, SECRET, moto_endpoint, s3  # noqa: F401 -- fixtures

# Shard sizes: with input.rows_per_unit=3 the plan has 1 + 2 + 2 = 5 units over 3 files.
SHARDS = {"a.parquet": 3, "b.parquet": 4, "c.parquet": 5}


def upload_shards(fs) -> dict[str, str]:
    """Parquet shards under s3://BUCKET/in/ (written through s3fs, multiple row groups); returns
    id -> prompt of every row."""
    prompts = {}
    for i, (name, n) in enumerate(SHARDS.items()):
        rows = prompt_rows(n, prefix=name.split(".")[0], seed=i)
        prompts.update({r["id"]: r["prompt"] for r in rows})
        with fs.open(f"{BUCKET}/in/{name}", "wb") as f:
            pq.write_table(pa.Table.from_pylist(rows), f, row_group_size=2)
    assert sorted(fs.find(f"{BUCKET}/in")) == [f"{BUCKET}/in/{n}" for n in SHARDS]
    return prompts


def read_kind(fs, run: str, kind: str) -> list[dict]:
    files = sorted(fs.glob(f"{run}/{kind}/*.parquet"))
    rows = []
    for path in files:
        with fs.open(path, "rb") as f:
            rows += pq.read_table(f).to_pylist()
    return rows


def check_run(fs, endpoint: str, prompts: dict[str, str], summary: dict, cache_dir) -> None:
    """The committed output of run `t` under s3://BUCKET/out, read back over S3."""
    run = f"{BUCKET}/out/t"
    objects = fs.find(run)
    assert f"{run}/_SUCCESS" in objects and f"{run}/manifest.json" in objects, objects
    assert not [o for o in objects if "/_staging" in o], objects        # no staging object left
    assert summary["output"] == f"s3://{run}"

    completions, rounds, errors = (read_kind(fs, run, k) for k in ("completions", "rounds", "errors"))
    assert errors == []
    ids = Counter(c["id"] for c in completions)
    assert set(ids) == set(prompts) and set(ids.values()) == {1}, ids      # every input id exactly once
    emitted = Counter()
    for r in rounds:
        emitted[r["id"]] += r["emitted"]
    for c in completions:
        assert 0 < c["completion_tokens"] <= 8 and c["text"]
        assert emitted[c["id"]] == c["completion_tokens"], c["id"]         # rounds add up per row
        assert c["source_file"].startswith(f"s3://{BUCKET}/in/")
    assert sum(c["rounds"] for c in completions) == len(rounds)
    assert {c["worker"] for c in completions} <= {"w0", "w1"}

    with fs.open(f"{run}/manifest.json") as f:
        manifest = json.load(f)
    assert manifest["units"] == 5 == len(fs.glob(f"{run}/_committed/*.json"))
    assert manifest["rows"] == manifest["completions"] == len(prompts) and manifest["errors"] == 0
    assert manifest["tokens"] == sum(c["completion_tokens"] for c in completions)
    for kind in ("completions", "rounds", "errors"):
        listed = manifest["files"][kind]
        assert len(listed) == 5 and all(u.startswith(f"s3://{run}/{kind}/") for u in listed)
        assert sorted(u[len("s3://"):] for u in listed) == sorted(fs.glob(f"{run}/{kind}/*.parquet"))
    with fs.open(f"{run}/config.yaml") as f:
        stored = f.read().decode()
    assert SECRET not in stored and KEY not in stored                    # credentials redacted

    # `datasets` reads the published files straight from the store (s3fs under fsspec) by glob.
    import datasets
    options = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION}}
    ds = datasets.load_dataset("parquet", data_files={"train": f"s3://{run}/completions/*.parquet"},
                               storage_options=options, split="train", cache_dir=str(cache_dir))
    assert sorted(ds["id"]) == sorted(prompts)
    ds_rounds = datasets.load_dataset("parquet", data_files=manifest["files"]["rounds"],
                                      storage_options=options, split="train", cache_dir=str(cache_dir))
    assert ds_rounds.num_rows == len(rounds)


def test_job_on_s3_with_storage_config(tiny_model_dir, ray_head, s3, moto_endpoint, tmp_path):
    prompts = upload_shards(s3)
    cfg = job_config(tiny_model_dir, f"s3://{BUCKET}/in/", f"s3://{BUCKET}/out",
                     f"cluster.address={ray_head.address}", "input.rows_per_unit=3",
                     f"storage.endpoint_url={moto_endpoint}", f"storage.key={KEY}", f"storage.secret={SECRET}",
                     f"storage.region={REGION}")
    summary = run_job(cfg)
    assert summary["units"] == 5 and summary["completions"] == len(prompts) == 12
    check_run(s3, moto_endpoint, prompts, summary, tmp_path / "hf-cache")


@pytest.mark.slow
def test_job_on_s3_with_aws_environment_and_glob(tiny_model_dir, ray_head, s3, moto_endpoint, monkeypatch,
                                                  tmp_path):
    prompts = upload_shards(s3)
    s3.pipe(f"{BUCKET}/in/notes.txt", b"not an input shard")             # the glob leaves it out
    # Set after the Ray head started: workers can only learn these through the job's config.
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_REGION", REGION)
    cfg = job_config(tiny_model_dir, f"s3://{BUCKET}/in/*.parquet", f"s3://{BUCKET}/out",
                     f"cluster.address={ray_head.address}", "input.rows_per_unit=3")
    assert cfg.storage.endpoint_url is None and cfg.storage.key is None
    summary = run_job(cfg)
    assert summary["units"] == 5 and summary["completions"] == len(prompts) == 12
    # The same job again in this process resumes from the markers on the store: nothing to run.
    again = run_job(cfg)
    assert again["units_skipped"] == 5 and again["rows_this_run"] == 0 and again["completions"] == 12
    check_run(s3, moto_endpoint, prompts, summary, tmp_path / "hf-cache")


@pytest.mark.parametrize("path", [f"s3://{BUCKET}/missing/", f"s3://{BUCKET}/missing/*.parquet",
                                  f"s3://{BUCKET}/missing/x.parquet", "s3://specpipe-no-such-bucket/in/"])
def test_missing_s3_input_fails_before_ray(path, tiny_model_dir, s3, moto_endpoint, monkeypatch):
    s3.pipe(f"{BUCKET}/in/a.parquet", b"")                               # the bucket is not empty

    def no_ray(*args, **kwargs):
        raise AssertionError("the job reached Ray with a missing input")
    monkeypatch.setattr(driver, "connect", no_ray)
    monkeypatch.setattr(driver, "WorkerPool", no_ray)
    cfg = job_config(tiny_model_dir, path, f"s3://{BUCKET}/out", "cluster.address=127.0.0.1:1",
                     f"storage.endpoint_url={moto_endpoint}", f"storage.key={KEY}", f"storage.secret={SECRET}",
                     f"storage.region={REGION}")
    with pytest.raises(InputError) as err:
        run_job(cfg)
    assert path in str(err.value)
    assert s3.find(f"{BUCKET}/out") == []                                # nothing written either
