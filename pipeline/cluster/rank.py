"""A tensor-parallel replica's ranks on Ray, set up the same way for the job's pool and the processor's
stage.

A replica of N ranks is one STRICT_PACK placement group of N bundles, rank r in bundle r. Rank 0 runs
the round (the job's GenerationWorker, the processor's stage); `ReplicaRanks` owns the rest: the group
(`placement_group`, made before rank 0 starts, as rank 0 runs in bundle 0), ranks 1..N-1 as RankWorker
actors in bundles 1..N-1 (`start`, called by whoever supervises the replica: the job's pool, the
processor's stage), and rank 0's side of the rendezvous, in rank 0's process: the store opened on its
node (`rendezvous`), then its place in the replica once every rank has joined (`join`).

A rank's `serve(address)` loads its part of the target and runs the steps rank 0 sends
(pipeline/job/replica.py's serve_rank); it returns only when rank 0 tells it to stop, so while the
replica works it is pending, and whoever holds the call learns of this rank's death (killed, OOM, node
lost) from it. Failure drills come as a fault plan (faults.py).

Knows Ray's placement groups and the actors' API; knows nothing about units, the round or the driver.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ..io.storage import StorageConfig
from ..job.config import JobConfig, ModelsConfig
from .faults import FaultPlan

if TYPE_CHECKING:
    from ..engine.parallel.steps import TensorParallel


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
        return serve_rank(spec, address, self.rank, m.tensor_parallel_size, self.startup_timeout_s, self._faults)


class Rendezvous(NamedTuple):
    """Where a replica's ranks meet: host:port on rank 0's node, and the store rank 0 serves there."""
    address: str
    store: object


@dataclass(frozen=True)
class ReplicaRanks:
    """How one replica's ranks are placed, started and joined."""
    models: ModelsConfig                    # models.tensor_parallel_size ranks, each loading its part
    storage: StorageConfig                  # access to a target kept in object storage
    num_cpus: float                         # per rank
    num_gpus: float                         # per rank
    startup_timeout_s: float                # loading and joining
    timeout_s: float                        # each collective once every rank serves

    @classmethod
    def for_job(cls, cfg: JobConfig) -> ReplicaRanks:
        c = cfg.cluster
        return cls(cfg.models, cfg.storage, c.num_cpus_per_worker, c.num_gpus_per_worker, c.load_timeout_s,
                   c.collective_timeout_s)

    @property
    def size(self) -> int:
        return self.models.tensor_parallel_size

    def placement_group(self):
        """The replica's STRICT_PACK placement group: one bundle of num_cpus (and num_gpus) per rank."""
        from ray.util.placement_group import placement_group
        bundle = {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {})}
        return placement_group([bundle] * self.size, strategy="STRICT_PACK")

    @staticmethod
    def in_bundle(group, rank: int):
        """The scheduling strategy that puts an actor in rank `rank`'s bundle of `group`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)

    def actor_options(self, group, rank: int) -> dict:
        """Ray options of rank `rank`'s actor: its bundle's resources, never restarted (a lost rank loses
        its replica)."""
        return dict(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0,
                    scheduling_strategy=self.in_bundle(group, rank))

    def start(self, group, address, faults=lambda rank: FaultPlan()) -> tuple[list, dict]:
        """Ranks 1..N-1 as actors in bundles 1..N-1 of `group`, each serving `address` (rank 0's
        rendezvous: the address, or the ref of the call that returns it), rank r with the fault plan
        faults(r): (actors, {pending serve() ref: rank})."""
        import ray
        actors = [ray.remote(RankWorker).options(**self.actor_options(group, r)).remote(
            self.models, self.storage, max(1, int(self.num_cpus)), self.startup_timeout_s, r, faults(r))
            for r in range(1, self.size)]
        return actors, {a.serve.remote(address): r for r, a in enumerate(actors, 1)}

    def rendezvous(self) -> Rendezvous:
        """In rank 0's process: the replica's store, opened on this node at a free port."""
        import ray

        from ..engine.parallel.group import free_address, open_rendezvous
        address = free_address(ray.util.get_node_ip_address())
        return Rendezvous(address, open_rendezvous(address, self.size, self.startup_timeout_s))

    def join(self, rendezvous: Rendezvous) -> TensorParallel:
        """In rank 0's process: its place in the replica, once every rank has joined `rendezvous`
        (within startup_timeout_s)."""
        from ..job.replica import open_replica
        return open_replica(rendezvous.address, self.size, self.models.device, self.startup_timeout_s,
                            self.timeout_s, store=rendezvous.store)
