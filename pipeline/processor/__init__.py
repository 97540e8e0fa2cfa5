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

from .config import SpecpipeProcessorConfig
from .rows import OUTPUT
from .stage import SpecpipeStage, config_digest

__all__ = ["OUTPUT", "Processor", "SpecpipeProcessorConfig", "build_processor"]
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
        if cpus and lo * ranks * cfg.num_cpus >= cpus:
            log.warning("the processor's %d replica(s) x %d rank(s) x %s CPUs take all %s CPUs of the cluster: Ray "
                        "Data's read and write tasks get none and the dataset waits until the cluster grows; give "
                        "the replicas fewer CPUs (num_cpus) or the cluster more", lo, ranks, cfg.num_cpus, cpus)
        remote = {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus}
        if ranks > 1:       # each replica's ranks in a placement group of its own (rank 0: the stage, bundle 0)
            remote["ray_remote_args_fn"] = functools.partial(replica_placement, ranks, cfg.num_cpus, cfg.num_gpus)
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


def replica_placement(ranks: int, num_cpus: float, num_gpus: float) -> dict:
    """A new replica's Ray options: a STRICT_PACK placement group of one bundle per rank, the stage in
    bundle 0 (its ranks take the others: stage.py)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    group = placement_group([bundle] * ranks, strategy="STRICT_PACK")
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)}


def _prepare_rounds_log(config: SpecpipeProcessorConfig) -> None:
    """The rounds log's run folder: its config and an open plan (units are the batches, as they come)."""
    from ..io.writer import RunOutput
    tree = config.tree()
    RunOutput(config.rounds_path, config.run_id, config.storage).prepare(
        [], config_digest(config), tree, tree, resume=True)
