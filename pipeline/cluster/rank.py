"""A tensor-parallel rank other than rank 0: a Ray actor in its replica's placement group that loads
its part of the target and runs the steps rank 0 sends (pipeline/job/replica.py's serve_rank).

`serve(address)` returns only when rank 0 tells it to stop; while the replica works it is pending, so
the pool learns of this rank's death (killed, OOM, node lost) from that call. Failure drills come as
a fault plan (faults.py).

Knows the actor's API; knows nothing about units, the round or the driver.
"""
from __future__ import annotations

import os

from ..job.config import JobConfig
from ..job.replica import serve_rank
from ..loading.models import ModelSpec
from .faults import FaultPlan


class RankWorker:
    def __init__(self, cfg: JobConfig, name: str, rank: int, index: int = 0, incarnation: int = 0):
        self.cfg, self.name, self.rank = cfg, name, rank
        self._faults = FaultPlan.for_rank(cfg.debug, index, incarnation, rank, cfg.models.tensor_parallel_size)

    def ping(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}

    def serve(self, address: str) -> int:
        """Load this rank's part of the target, join the replica at `address`, run rank 0's steps."""
        import torch

        from ..io.reader import storage_options
        from ..loading.hardware import resolve_dtype
        m = self.cfg.models
        torch.set_num_threads(max(1, int(self.cfg.cluster.num_cpus_per_worker)))
        options = storage_options(m.target, self.cfg.storage) if "://" in m.target else None
        spec = ModelSpec(m.target, resolve_dtype(m.dtype, m.device).dtype, m.device, m.trust_remote_code, options)
        return serve_rank(spec, address, self.rank, m.tensor_parallel_size, self.cfg.cluster.load_timeout_s,
                          self._faults.after_rank_step)
