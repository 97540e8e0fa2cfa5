"""Tensor-parallel replicas for tests: rank 0 in the test's process, ranks 1..N-1 in spawned processes
that load their part of a saved model by slices and run rank 0's steps (the job's ranks are Ray actors
around the same serve loop: tests/cluster/test_tensor_parallel_job.py)."""
from __future__ import annotations

import copy
import multiprocessing
import shutil
from pathlib import Path

import torch

from pipeline.engine.config import EngineConfig
from pipeline.engine.model.plan import Kernels
from pipeline.engine.model.runner import ModelRunner
from pipeline.cluster.faults import FaultPlan
from pipeline.engine.parallel.group import Heartbeat, RankGroup, free_address
from pipeline.engine.parallel.shard import Split, shard_model
from pipeline.engine.parallel.steps import TensorParallel, serve
from pipeline.job.replica import open_replica
from pipeline.loading.models import ModelSpec, resolve_hf_dir
from pipeline.loading.shards import load_model_shard

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_model(model, folder: Path) -> Path:
    """The model as safetensors in `folder`, with a real tokenizer beside it (the loader reads one)."""
    model.save_pretrained(folder)
    src = resolve_hf_dir("smollm2-135m-instruct")
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, folder / name)
    return folder


def _rank_main(model_dir: str, address: str, rank: int, size: int, dump: str | None, drill: FaultPlan) -> None:
    """A rank process as the job's (job/replica.py's serve_rank: its heartbeat from the start, the
    drill's hooks): its slices loaded, each step of rank 0 run; at stop, its last runner's KV store
    written to `dump` (safetensors: k<layer>, v<layer>) where asked."""
    torch.set_num_threads(1)
    heartbeat = Heartbeat(address, rank, 120)
    drill.on_rank_load()
    model, _, _ = load_model_shard(ModelSpec(model_dir, "float32"), size, rank)
    heartbeat.mark("loaded")
    group = RankGroup.join(address, rank, size, "cpu", 120)
    tp, runners = TensorParallel(group), []

    def build(config, kernels):
        drill.on_rank_build()
        runners.append(ModelRunner(model, EngineConfig(**config), Kernels(**kernels), tp=tp))
        return runners[-1]
    serve(group, build, drill.after_rank_step, heartbeat.mark)
    heartbeat.stop()
    if dump:
        from safetensors.torch import save_file
        cache = runners[-1].cache
        save_file({**{f"k{i}": k for i, k in enumerate(cache.keys)}, **{f"v{i}": v for i, v in enumerate(cache.values)}},
                  dump)


class Replica:
    """A replica of `size` ranks over the model saved in `model_dir`: `tp` is rank 0's place in it,
    `shard(model)` rank 0's part of a copy of `model` (the same weights). dump_dir: each other rank's
    KV store written there at close (rank<r>.safetensors). timeout_s bounds each collective and a rank's
    silence, startup_s (default timeout_s) the ranks' loading and runner builds; drill: the last rank's
    fault plan (pipeline/cluster/faults.py: stop_rank_in stops its process in a phase)."""

    def __init__(self, model_dir: Path, size: int, dump_dir: Path | None = None, timeout_s: float = 120,
                 startup_s: float | None = None, drill: FaultPlan = FaultPlan()):
        self.size, self.dump_dir = size, dump_dir
        address = free_address("127.0.0.1")
        ctx = multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=_rank_main, daemon=True,
                                  args=(str(model_dir), address, r, size,
                                        str(dump_dir / f"rank{r}.safetensors") if dump_dir else None,
                                        drill if r == size - 1 else FaultPlan()))
                      for r in range(1, size)]
        for p in self.procs:
            p.start()
        try:
            self.tp = open_replica(address, size, "cpu", startup_s or timeout_s, timeout_s)
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL every rank process (a stopped one too)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=30)

    def shard(self, model):
        return shard_model(copy.deepcopy(model), Split.of(model.config, self.size, 0))

    def close(self) -> list[int]:
        """Stop the ranks; their exit codes."""
        self.tp.peers.stop()
        for p in self.procs:
            p.join(timeout=60)
        self.tp.group.close()
        return [p.exitcode for p in self.procs]
