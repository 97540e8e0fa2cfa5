"""A tensor-parallel replica's ranks, from the job's side: rank 0's group and the other ranks' loop.

Rank 0 (the worker holding the engine) opens the rendezvous (`open_replica`) and joins it; each other
rank (`serve_rank`, in its own process: a Ray actor in a job, a spawned process in tests) loads only
its slices of the target, joins, and runs the steps rank 0 sends until told to stop. Startup (loading,
measuring kernels) is bounded by `startup_timeout_s`; each collective after it by the replica's
`timeout_s`, with beats every quarter of it while rank 0 is idle.

Knows the engine's constructors and model loading; knows nothing about Ray or units.
"""
from __future__ import annotations

from ..engine.config import EngineConfig
from ..engine.model.plan import Kernels
from ..engine.model.runner import ModelRunner
from ..engine.parallel.group import RankGroup, open_rendezvous
from ..engine.parallel.steps import Peers, TensorParallel, serve
from ..loading.models import ModelSpec
from ..loading.shards import load_model_shard


def open_replica(address: str, size: int, device: str, startup_timeout_s: float, timeout_s: float,
                 store=None) -> TensorParallel:
    """Rank 0's place in a replica of `size` ranks whose rendezvous is `address` (host:port, on this
    host; `store`: the one open_rendezvous opened there already): blocks until every rank has joined
    (within startup_timeout_s)."""
    store = store or open_rendezvous(address, size, startup_timeout_s)
    group = RankGroup.join(address, 0, size, device, startup_timeout_s, store=store)
    return TensorParallel(group, timeout_s, Peers(group, beat_s=timeout_s / 4))


def serve_rank(spec: ModelSpec, address: str, rank: int, size: int, startup_timeout_s: float,
               after_step=lambda steps: None) -> int:
    """Rank `rank` (>= 1) of a replica: its part of the target loaded, then each step rank 0 sends run,
    until rank 0 says stop (returns the steps run) or is gone (RankLost)."""
    model, _, _ = load_model_shard(spec, size, rank, tokenizer=False)
    group = RankGroup.join(address, rank, size, spec.device, startup_timeout_s)
    tp = TensorParallel(group)
    try:
        return serve(group, lambda config, kernels: ModelRunner(model, EngineConfig(**config), Kernels(**kernels),
                                                                tp=tp),
                     after_step)
    finally:
        group.close()
