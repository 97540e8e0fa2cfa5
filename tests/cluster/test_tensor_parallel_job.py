"""Tensor-parallel replicas in the distributed job, on a real local Ray (`ray start --head`): a worker of
2 ranks (2 actors in one STRICT_PACK placement group, gloo between their processes) writes the tokens a
worker of 1 rank writes (fp32 greedy), each rank holding its part of the weights; a rank process that
dies mid-run fails its replica, whose units the job re-queues to the replacement, exactly once."""
import dataclasses

import pyarrow.parquet as pq
import pytest

from pipeline.cluster.driver import run_job
from pipeline.engine.parallel.shard import Split
from pipeline.job.rows import prompt_ids
from pipeline.job.runtime import build_engine
from pipeline.loading.models import ModelSpec, load_model
from pipeline_util import check_exactly_once, job_config, read_run, shards


def expected_rank_bytes(model_dir, size: int) -> int:
    """Bytes one rank of `size` holds: each split weight's 1/size part, each replicated weight whole
    (a tied LM head: its vocabulary part beside the whole embedding)."""
    model, _ = load_model(ModelSpec(str(model_dir), "float32"))
    split = Split.of(model.config, size)
    return sum(p.numel() * p.element_size() // (size if split.slice_of(n) is not None else 1)
               for n, p in model.named_parameters(remove_duplicate=False))


def test_two_ranks_write_the_tokens_of_one(tiny_model_dir, ray_head, tmp_path):
    """The job at 2 ranks against the same engine of 1 rank, here in this process, on the same rows."""
    ids = shards(tmp_path / "in", files=2, rows=6)
    cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "tp2"), f"cluster.address={ray_head.address}",
                     "cluster.num_workers=1", "models.tensor_parallel_size=2", "sampling.max_tokens=12")
    summary = run_job(cfg)
    run = read_run(tmp_path / "tp2" / "t")
    check_exactly_once(run, ids)
    one = build_engine(dataclasses.replace(cfg.models, tensor_parallel_size=1), cfg.drafting, cfg.engine)
    by_id = {r["id"]: r for f in sorted((tmp_path / "in").glob("*.parquet")) for r in pq.read_table(f).to_pylist()}
    for rid in ids:
        one.engine.add_request(rid, prompt_ids(one.tokenizer, by_id[rid]["prompt"]), cfg.sampling)
    expected = {c.request_id: c.output_ids for c in one.engine.run()}
    assert {c["id"]: c["token_ids"] for c in run["completions"]} == expected and len(expected) == len(ids)
    ranks = summary["workers"][0]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["backend"] for r in ranks} == {"gloo"}
    assert {r["weight_bytes"] for r in ranks} == {expected_rank_bytes(tiny_model_dir, 2)}
    assert ranks[0]["weight_bytes"] < one.engine.target.weight_bytes


@pytest.mark.slow
def test_rank_killed_mid_run_job_completes_exactly_once(tiny_model_dir, ray_head, tmp_path):
    """Rank 1 of the first replica exits (os._exit: its process gone, sockets closed) after 3 steps:
    the replica is retired naming the rank, its units re-queued, and the replacement replica (2 new
    rank processes) finishes every row once."""
    ids = shards(tmp_path / "in", files=2, rows=9)
    cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"),
                     f"cluster.address={ray_head.address}", "cluster.num_workers=1",
                     "models.tensor_parallel_size=2", "debug.crash_rank_after_steps=3", "sampling.max_tokens=12")
    summary = run_job(cfg)
    assert summary["worker_restarts"] >= 1 and summary["unit_retries"] >= 1
    assert "rank 1 died" in summary["workers_lost"]["w0"], summary["workers_lost"]
    run = read_run(tmp_path / "out" / "t")
    check_exactly_once(run, ids)
    assert {c["worker"] for c in run["completions"]} == {"w0.1"}


@pytest.mark.slow
def test_rank_stopped_while_loading_replica_replaced_within_the_timeout(tiny_model_dir, ray_head, tmp_path):
    """Rank 1 of the first replica stops (SIGSTOP: its process frozen, its sockets open) as it starts
    loading: the replica is retired once the rank has been silent for collective_timeout_s (not at the
    load's own 900 s, nor at Ray's keepalive), the cause saying it stopped answering, and the replacement
    replica finishes every row once."""
    ids = shards(tmp_path / "in", files=2, rows=6)
    cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"), f"cluster.address={ray_head.address}",
                     "cluster.num_workers=1", "models.tensor_parallel_size=2", "debug.stop_rank_in=load",
                     "cluster.collective_timeout_s=5", "sampling.max_tokens=8")
    summary = run_job(cfg)
    lost = summary["workers_lost"]["w0"]
    assert "rank 1 of 2 stopped answering: no heartbeat for" in lost and "while loading its part of the target" in lost
    assert summary["worker_restarts"] >= 1
    run = read_run(tmp_path / "out" / "t")
    check_exactly_once(run, ids)
    assert {c["worker"] for c in run["completions"]} == {"w0.1"}
