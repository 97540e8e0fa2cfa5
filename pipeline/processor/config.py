"""SpecpipeProcessorConfig: the processor's configuration, in Ray Data LLM's shape.

The engine sections are the job's own dataclasses (`models`, `drafting`, `engine`, `sampling`: the
same keys and checks as the YAML), each also accepted as a plain dict; the rest says how Ray Data
runs the stage (batch size, replicas, resources) and what happens to bad rows and the rounds log.

Mapping from Ray Data LLM's `vLLMEngineProcessorConfig` (README, "Inside a Ray Data pipeline", has it whole):
    model_source                 models.target (and models.draft for a draft model)
    engine_kwargs                engine (max_num_seqs, max_model_len, ...), models (dtype, tensor_parallel_size)
                                 and drafting (its speculative_config)
    batch_size, concurrency      batch_size, concurrency (an int: a fixed pool; a (min, max) autoscaling range)
    max_concurrent_batches       batches_per_replica (also Ray Data's tasks in flight per replica)
    accelerator_type             accelerator_type (with num_gpus per replica)
    placement_group_config       from num_cpus, num_gpus and models.tensor_parallel_size
    should_continue_on_error     should_continue_on_error (on by default here); the error column is `error`
    chat_template/tokenize/detokenize stages   in the replica: rows with `messages` take the tokenizer's template
    row["sampling_params"]       row["sampling_params"] (the keys of SamplingParams; others are errors)

Knows the engine's and the job's configs; knows nothing about Ray.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..engine.config import DraftingConfig, EngineConfig
from ..engine.core.request import RequestError, SamplingParams
from ..errors import ConfigError
from ..io.storage import StorageConfig
from ..job.config import RUN_ID, ModelsConfig

SECTIONS = {"models": ModelsConfig, "drafting": DraftingConfig, "engine": EngineConfig,
            "sampling": SamplingParams, "storage": StorageConfig}


@dataclass
class SpecpipeProcessorConfig:
    models: Any = field(default_factory=ModelsConfig)          # ModelsConfig or its dict
    drafting: Any = field(default_factory=DraftingConfig)      # DraftingConfig or its dict
    engine: Any = field(default_factory=EngineConfig)          # EngineConfig or its dict
    sampling: Any = field(default_factory=SamplingParams)      # every row's defaults (SamplingParams or
                                                               # its dict); a row's sampling_params override
    batch_size: int = 64                    # rows per batch handed to a replica
    concurrency: Any = 1                    # replicas: n, or (min, max) for an autoscaling pool
    num_cpus: float = 1                     # per replica (also its torch threads, at least 1)
    num_gpus: float = 0                     # per replica (models.device=cuda needs > 0)
    accelerator_type: Optional[str] = None  # e.g. "H100": replicas only on such nodes
    batches_per_replica: int = 4            # batches a replica holds at once: rows of the next batches
                                            # join the running batch as earlier ones finish
    id_column: Optional[str] = None         # the rows' id: seeds each row's sampling (reruns draw the
                                            # same tokens); without it, the row's content does
    seed: int = 0                           # with the row's id or content, each row's generators' seed
    should_continue_on_error: bool = True   # a bad row becomes an output row with `error` set; False:
                                            # the first bad row fails the dataset
    rounds_path: Optional[str] = None       # folder/URL: per-round acceptance logs, read by
                                            # `python -m pipeline.report <rounds_path>/<run_id>`
    run_id: str = "processor"               # the rounds log's run folder under rounds_path
    storage: Any = field(default_factory=StorageConfig)        # object-store access for rounds_path
    startup_timeout_s: float = 900          # tensor parallel: a replica's ranks must load and join by then
    collective_timeout_s: float = 120       # tensor parallel: a collective between a replica's ranks not
                                            # done by then, or a rank silent (no heartbeat) this long in
                                            # any phase, ends the replica (Ray Data restarts it)

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            setattr(self, name, section(name, cls, getattr(self, name)))
        for key, low in (("batch_size", 1), ("batches_per_replica", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{key}: expected an integer >= {low}, got {value!r}")
        self.concurrency = replicas(self.concurrency)
        if not (isinstance(self.num_cpus, (int, float)) and self.num_cpus > 0):
            raise ConfigError(f"num_cpus: expected a number > 0, got {self.num_cpus!r}")
        for key in ("startup_timeout_s", "collective_timeout_s"):
            if not (isinstance(getattr(self, key), (int, float)) and getattr(self, key) > 0):
                raise ConfigError(f"{key}: expected a number of seconds > 0, got {getattr(self, key)!r}")
        if not (isinstance(self.num_gpus, (int, float)) and self.num_gpus >= 0):
            raise ConfigError(f"num_gpus: expected a number >= 0, got {self.num_gpus!r}")
        if self.models.device.startswith("cuda") and self.num_gpus <= 0:
            raise ConfigError("num_gpus: models.device=cuda needs a GPU per replica (> 0)")
        if self.drafting.uses_draft_model and not self.models.draft:
            raise ConfigError(f"models.draft: required when drafting.method={self.drafting.method!r}")
        if not RUN_ID.fullmatch(self.run_id):
            raise ConfigError(f"run_id: expected 1-128 letters, digits, '.', '_' or '-', got {self.run_id!r}")
        if self.id_column is not None and not (isinstance(self.id_column, str) and self.id_column):
            raise ConfigError(f"id_column: expected a column name or None, got {self.id_column!r}")

    @property
    def threads(self) -> int:
        return max(1, int(self.num_cpus))

    def tree(self) -> dict:
        """The config as plain data (what a replica is built from, and what the rounds log records)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in SECTIONS:
            out[name] = asdict(out[name])
        out["concurrency"] = list(self.concurrency)
        return out


def section(name: str, cls: type, value):
    """`value` as the dataclass `cls`: itself, or a dict checked like the YAML (errors name the key)."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected {cls.__name__} or a dict, got {type(value).__name__}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), value))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e.msg if hasattr(e, "msg") else e).splitlines()[0]
        raise ConfigError(f"{name}.{key}: {msg}" if key else f"{name}: {msg}") from None
    except RequestError as e:
        raise ConfigError(f"{name}.{e}") from None


def replicas(concurrency) -> tuple[int, int]:
    """(min, max) replicas from an int n (a fixed pool: (n, n)) or a (min, max) pair."""
    if isinstance(concurrency, int) and not isinstance(concurrency, bool):
        lo = hi = concurrency
    elif isinstance(concurrency, (tuple, list)) and len(concurrency) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in concurrency):
        lo, hi = concurrency
    else:
        raise ConfigError(f"concurrency: expected an integer or a (min, max) pair, got {concurrency!r}")
    if not 1 <= lo <= hi:
        raise ConfigError(f"concurrency: expected 1 <= min <= max, got {concurrency!r}")
    return lo, hi
