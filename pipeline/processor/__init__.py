"""specpipe inside Ray Data pipelines: `build_processor` with Ray Data LLM's signature.

    from pipeline.processor import SpecpipeProcessorConfig, build_processor

    processor = build_processor(
        SpecpipeProcessorConfig(models={"target": "smollm2-135m-instruct"}, drafting={"method": "ngram"},
                                sampling={"max_tokens": 128}, batch_size=32, concurrency=2, num_cpus=2),
        preprocess=lambda row: {"messages": [{"role": "user", "content": row["question"]}], **row},
        postprocess=lambda row: {"answer": row["generated_text"], **row})
    ds = processor(ray.data.read_parquet("prompts/"))

The processor is `preprocess` (a row map), the stage (stage.py: an actor pool, one engine per
replica, rows in -> rows out with the columns of rows.py's OUTPUT) and `postprocess` (a row map).
Ray Data LLM's own `build_processor` finds processors through a registry that is internal to Ray
(`ray.llm._internal`), so specpipe's processor is built here, with the same signature; a pipeline
switches by changing its config class and the import.

Knows Ray Data's Dataset API; the row contract is rows.py's, the replica stage.py's.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

from ..errors import ConfigError
from .config import SpecpipeProcessorConfig
from .rows import OUTPUT
from .stage import SpecpipeStage, config_digest, replica_ranks

__all__ = ["OUTPUT", "Processor", "SpecpipeProcessorConfig", "actor_cpus", "build_processor"]
log = logging.getLogger(__name__)


class Processor:
    """Callable on a `ray.data.Dataset`: returns the dataset with generated columns (lazily, as Ray Data does)."""

    def __init__(self, config: SpecpipeProcessorConfig, preprocess: Optional[Callable] = None,
                 postprocess: Optional[Callable] = None, preprocess_map_kwargs: Optional[dict] = None,
                 postprocess_map_kwargs: Optional[dict] = None):
        self.config = config
        self.preprocess, self.postprocess = preprocess, postprocess
        self.preprocess_map_kwargs = preprocess_map_kwargs or {}
        self.postprocess_map_kwargs = postprocess_map_kwargs or {}
        if config.rounds_path:
            _prepare_rounds_log(config)

    def __call__(self, dataset):
        import ray
        import ray.data
        cfg = self.config
        if self.preprocess is not None:
            dataset = dataset.map(self.preprocess, **self.preprocess_map_kwargs)
        lo, hi = cfg.concurrency
        ranks = cfg.models.tensor_parallel_size
        cpus = ray.cluster_resources().get("CPU", 0) if ray.is_initialized() else 0
        held = actor_cpus(cfg)
        if cpus and held >= cpus:
            filter_ = " + Ray Data's checkpoint filter" if checkpoint_filter_cpus() else ""
            raise ConfigError(
                f"num_cpus: the dataset's actors would hold {held:g} of the cluster's {cpus:g} CPUs ({lo} replica(s) x "
                f"{ranks} rank(s) x {cfg.num_cpus:g} CPUs{filter_}), leaving Ray Data's read and write tasks none: "
                "the dataset would wait forever; give the replicas fewer CPUs (num_cpus) or the cluster more")
        remote = {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus}
        if ranks > 1:       # each replica's ranks in a placement group of its own (rank 0: the stage, bundle 0)
            # Ray 2.60 deprecates ray_remote_args_fn and Ray 2.64 removes it; Ray names no replacement for a
            # placement group per actor (Ray Data LLM's own vLLM stage passes the same argument), so the
            # project requires ray < 2.64 (pyproject.toml) until Ray names one.
            remote["ray_remote_args_fn"] = functools.partial(replica_placement, cfg)
        if cfg.accelerator_type is not None:
            remote["accelerator_type"] = cfg.accelerator_type
        # max_concurrent_calls_per_actor: the replica's calls running at once (each awaits its rows on the
        # one engine); without it a replica holds one batch and its engine drains at every batch boundary (tested)
        dataset = dataset.map_batches(
            SpecpipeStage, fn_constructor_args=(cfg,), batch_size=cfg.batch_size, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(min_size=lo, max_size=hi,
                                               max_tasks_in_flight_per_actor=cfg.batches_per_replica,
                                               max_concurrent_calls_per_actor=cfg.batches_per_replica),
            zero_copy_batch=True, **remote)
        if self.postprocess is not None:
            dataset = dataset.map(self.postprocess, **self.postprocess_map_kwargs)
        return dataset


def build_processor(config: SpecpipeProcessorConfig, preprocess: Optional[Callable] = None,
                    postprocess: Optional[Callable] = None, preprocess_map_kwargs: Optional[dict] = None,
                    postprocess_map_kwargs: Optional[dict] = None, **unsupported: Any) -> Processor:
    """Ray Data LLM's `build_processor(config, preprocess, postprocess, ...)` for specpipe."""
    if not isinstance(config, SpecpipeProcessorConfig):
        raise TypeError(f"config: expected SpecpipeProcessorConfig, got {type(config).__name__}")
    if unsupported:
        raise TypeError(f"build_processor: unsupported arguments {sorted(unsupported)}")
    return Processor(config, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs)


def actor_cpus(config: SpecpipeProcessorConfig) -> float:
    """The CPUs the dataset's actors hold for as long as it runs: the replicas' minimum pool (every rank
    of each) and, where Ray Data checkpoints (`DataContext.checkpoint_config`), its CheckpointFilter
    pool, one CPU per actor (Ray's default for actors: the checkpoint config has no CPU setting). Ray
    Data's read, map and write tasks need CPUs beyond these."""
    lo, _ = config.concurrency
    return lo * config.models.tensor_parallel_size * config.num_cpus + checkpoint_filter_cpus()


def checkpoint_filter_cpus() -> int:
    """The CPUs of Ray Data's CheckpointFilter pool where the DataContext checkpoints, else 0."""
    import ray.data
    checkpoint = ray.data.DataContext.get_current().checkpoint_config
    return 0 if checkpoint is None else getattr(checkpoint, "checkpoint_actor_pool_min_size", 1)


def replica_placement(config: SpecpipeProcessorConfig) -> dict:
    """A new replica's Ray options: its ranks' STRICT_PACK placement group (one bundle per rank), the
    stage in bundle 0 (its ranks take the others: stage.py)."""
    replica = replica_ranks(config)
    return {"scheduling_strategy": replica.in_bundle(replica.placement_group(), 0)}


def _prepare_rounds_log(config: SpecpipeProcessorConfig) -> None:
    """The rounds log's run folder: its config and an open plan (units are the batches, as they come)."""
    from ..io.writer import RunOutput
    tree = config.tree()
    RunOutput(config.rounds_path, config.run_id, config.storage).prepare(
        [], config_digest(config), tree, tree, resume=True)
