"""A tensor-parallel replica's ranks, from the job's side: rank 0's group and the other ranks' loop.

Rank 0 (the worker holding the engine) opens the rendezvous (`open_replica`) and joins it; each other
rank (`serve_rank`, in its own process: a Ray actor in a job, a spawned process in tests) loads only
its slices of the target, joins, and runs the steps rank 0 sends until told to stop. Startup (loading,
measuring kernels) is bounded by `startup_timeout_s`; each collective after it by the replica's
`timeout_s`, with beats every quarter of it while rank 0 is idle. Each other rank beats on the store
from before it loads until it leaves (group.Heartbeat): one that stops answering in any phase (loading,
joining, building its runner, a step, idle) fails the replica once it has been silent for `timeout_s`,
with a RankLost that says so and for how long, however long its phase may take.

Knows the engine's constructors and model loading; knows nothing about Ray or units.
"""
from __future__ import annotations

from ..engine.config import EngineConfig
from ..engine.model.plan import Kernels
from ..engine.model.runner import ModelRunner
from ..engine.parallel.group import Heartbeat, Pulses, RankGroup, open_rendezvous
from ..engine.parallel.steps import Peers, TensorParallel, serve
from ..loading.models import ModelSpec
from ..loading.shards import load_model_shard


def open_replica(address: str, size: int, device: str, startup_timeout_s: float, timeout_s: float,
                 store=None) -> TensorParallel:
    """Rank 0's place in a replica of `size` ranks whose rendezvous is `address` (host:port, on this
    host; `store`: the one open_rendezvous opened there already): blocks until every rank has joined
    (within startup_timeout_s)."""
    store = store or open_rendezvous(address, size, startup_timeout_s)
    pulses = Pulses(address, size, timeout_s)
    pulses.wait_for("loaded", "loading its part of the target", startup_timeout_s)
    group = RankGroup.join(address, 0, size, device, startup_timeout_s, store=store)
    return TensorParallel(group, timeout_s, Peers(group, timeout_s / 4, pulses, startup_timeout_s))


def serve_rank(spec: ModelSpec, address: str, rank: int, size: int, startup_timeout_s: float,
               drill=None) -> int:
    """Rank `rank` (>= 1) of a replica: its part of the target loaded, then each step rank 0 sends run,
    until rank 0 says stop (returns the steps run) or is gone (RankLost). drill: a fault plan whose
    on_rank_load, on_rank_build and after_rank_step hooks run at those points (None: no drill)."""
    heartbeat = Heartbeat(address, rank, startup_timeout_s)
    try:
        if drill is not None:
            drill.on_rank_load()
        model, _, _ = load_model_shard(spec, size, rank, tokenizer=False)
        heartbeat.mark("loaded")
        group = RankGroup.join(address, rank, size, spec.device, startup_timeout_s)
        tp = TensorParallel(group)

        def build(config: dict, kernels: dict) -> ModelRunner:
            if drill is not None:
                drill.on_rank_build()
            return ModelRunner(model, EngineConfig(**config), Kernels(**kernels), tp=tp)
        try:
            return serve(group, build, drill.after_rank_step if drill is not None else lambda steps: None,
                         heartbeat.mark)
        finally:
            group.close()
    finally:
        heartbeat.stop()
