"""A tensor-parallel rank other than rank 0: a Ray actor in its replica's placement group that loads
its part of the target and runs the steps rank 0 sends (pipeline/job/replica.py's serve_rank).

`serve(address)` returns only when rank 0 tells it to stop; while the replica works it is pending, so
whoever holds the call (the job's pool, the processor's stage) learns of this rank's death (killed,
OOM, node lost) from it. Failure drills come as a fault plan (faults.py).

Knows the actor's API; knows nothing about units, the round or the driver.
"""
from __future__ import annotations

import os

from ..io.storage import StorageConfig
from ..job.config import ModelsConfig
from .faults import FaultPlan


class RankWorker:
    def __init__(self, models: ModelsConfig, storage: StorageConfig, threads: int, startup_timeout_s: float,
                 rank: int, faults: FaultPlan = FaultPlan()):
        self.models, self.storage, self.threads, self.rank = models, storage, threads, rank
        self.startup_timeout_s, self._faults = startup_timeout_s, faults

    def ping(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}

    def serve(self, address: str) -> int:
        """Load this rank's part of the target, join the replica at `address`, run rank 0's steps."""
        import torch

        from ..io.reader import storage_options
        from ..job.replica import serve_rank
        from ..loading.hardware import resolve_dtype
        from ..loading.models import ModelSpec
        m = self.models
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        torch.set_num_threads(max(1, self.threads))
        options = storage_options(m.target, self.storage) if "://" in m.target else None
        spec = ModelSpec(m.target, resolve_dtype(m.dtype, m.device).dtype, m.device, m.trust_remote_code, options)
        return serve_rank(spec, address, self.rank, m.tensor_parallel_size, self.startup_timeout_s,
                          self._faults.after_rank_step)


def start_ranks(models: ModelsConfig, storage: StorageConfig, num_cpus: float, num_gpus: float,
                startup_timeout_s: float, group, host: str, faults=lambda rank: FaultPlan()):
    """Ranks 1..N-1 of a replica in bundles 1..N-1 of placement group `group`, each serving the store
    this process opens now on `host`: (address, store, {serve ref: rank}, actors)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ..engine.parallel.group import free_address, open_rendezvous
    size = models.tensor_parallel_size
    address = free_address(host)
    store = open_rendezvous(address, size, startup_timeout_s)
    actors = [ray.remote(RankWorker).options(
        num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r),
    ).remote(models, storage, max(1, int(num_cpus)), startup_timeout_s, r, faults(r)) for r in range(1, size)]
    return address, store, {a.serve.remote(address): r for r, a in enumerate(actors, 1)}, actors
