"""Typed job configuration: dataclasses composed by omegaconf structured configs.

YAML files in configs/ plus dotlist overrides (`engine.max_num_seqs=32`). Unknown keys and bad
values fail here, before any model is loaded, naming the key. Each component receives only its own
sub-config (models, drafting, engine, sampling, input, output, run).

This module knows nothing about models, Ray or files beyond reading the YAML it is given.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..engine.config import DraftingConfig, EngineConfig
from ..engine.core.request import RequestError, SamplingParams
from ..errors import ConfigError, one_of
from ..io.reader import InputConfig
from ..io.storage import StorageConfig
from ..loading.hardware import AUTO, EXPLICIT_DTYPES

DTYPES = (AUTO, *EXPLICIT_DTYPES)
SAME = "same"
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RANK_PHASES = ("", "load", "build", "step")     # debug.stop_rank_in: where a drill stops a rank ("": never)


@dataclass
class ModelsConfig:
    target: str = "smollm2-135m-instruct"   # shipped model name, .gguf file, or HF directory (safetensors)
    draft: Optional[str] = None              # draft model (same tokenizer) for drafting.method draft/hybrid
    dtype: str = AUTO                        # auto (each worker picks for its hardware: loading/hardware.py)
                                             # | float32 | bfloat16 | float16
    draft_dtype: str = AUTO                  # the draft model's: auto (what this hardware runs fastest, as
                                             # for dtype) | same (the target's) | float32 | bfloat16 | float16.
                                             # Its precision changes which tokens are proposed, never the
                                             # output distribution (the verifier corrects against the draft's
                                             # own q): a bf16 draft beside a forced fp32 target costs half
    device: str = "cpu"                      # cpu | cuda | cuda:N
    trust_remote_code: bool = False          # never run model code from a checkpoint unless set
    tensor_parallel_size: int = 1            # ranks one replica's target is split over (heads, MLP width,
                                             # vocabulary): a worker is this many actors in one placement
                                             # group, each with a bundle of cluster.num_cpus/gpus_per_worker;
                                             # the draft runs whole beside rank 0 (pipeline/engine/parallel/)

    def __post_init__(self):
        if not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool) \
                or self.tensor_parallel_size < 1:
            raise ConfigError(f"models.tensor_parallel_size: expected an integer >= 1, got {self.tensor_parallel_size!r}")
        one_of("models.dtype", self.dtype, DTYPES)
        one_of("models.draft_dtype", self.draft_dtype, (SAME, *DTYPES))
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"models.device: expected cpu, cuda or cuda:N, got {self.device!r}")


@dataclass
class OutputConfig:
    path: str = "out"                       # root folder/URL; a run writes under <path>/<run.run_id>/
    compression: str = "zstd"               # Parquet codec

    def __post_init__(self):
        one_of("output.compression", self.compression, ("zstd", "snappy", "gzip", "none"))


@dataclass
class ClusterConfig:
    address: Optional[str] = None           # Ray address; null = the job's cluster (ray job submit) or local Ray
    num_workers: int = 1                    # generation actors, each with its own target + draft
    num_cpus_per_worker: float = 1          # Ray CPUs per actor (also its torch threads, at least 1)
    num_gpus_per_worker: float = 0          # Ray GPUs per actor (models.device=cuda needs > 0)
    units_in_flight: int = 2                # units queued per actor at least (more when units are small:
                                            # enough rows for a running and a waiting batch, so the
                                            # next unit's rows enter before the current one drains)
    max_worker_restarts: int = 2            # replacement actors after deaths, over the whole job
    max_unit_attempts: int = 3              # a unit failing this many times fails the job
    placement_timeout_s: float = 60         # an actor not placed by then (no capacity) is given up:
                                            # the job goes on with the live workers, fails if none is left
    start_timeout_s: float = 300            # a placed actor's process must answer by then (a loaded node
                                            # starts processes slowly: that is no lack of capacity)
    load_timeout_s: float = 900             # a started actor's model load must finish by then
    stall_timeout_s: float = 600            # a worker holding units with no engine step or commit for
                                            # this long is taken as hung: killed, its units re-queued
    shutdown_grace_s: float = 30            # on SIGINT/SIGTERM, how long in-flight units may still commit
    collective_timeout_s: float = 120       # tensor parallel: a collective between a replica's ranks not
                                            # done by then, or a rank silent (no heartbeat) this long in
                                            # any phase, fails the replica (its units re-queued); an
                                            # idle rank 0 beats every quarter of it

    def __post_init__(self):
        for key, low in (("num_workers", 1), ("units_in_flight", 1), ("max_unit_attempts", 1),
                         ("max_worker_restarts", 0), ("placement_timeout_s", 1), ("start_timeout_s", 1),
                         ("load_timeout_s", 1), ("collective_timeout_s", 1),
                         ("stall_timeout_s", 1), ("shutdown_grace_s", 0)):
            if getattr(self, key) < low:
                raise ConfigError(f"cluster.{key}: expected >= {low}, got {getattr(self, key)}")
        if self.num_cpus_per_worker <= 0 or self.num_gpus_per_worker < 0:
            raise ConfigError("cluster.num_cpus_per_worker/num_gpus_per_worker: expected cpus > 0, gpus >= 0")


@dataclass
class DebugConfig:
    """Failure drills for tests; leave at the defaults in real runs."""
    crash_worker_after_steps: int = 0       # first incarnation of worker 0 exits (os._exit) after N steps
    crash_before_commit: bool = False       # workers exit after writing a unit's data, before its marker
    hang_worker_after_steps: int = 0        # first incarnation of worker 0 stops stepping after N steps
    hang_load: bool = False                 # first incarnation of worker 0 never finishes loading
    start_delay_s: float = 0                # first incarnation of worker 0 takes this long to start
                                            # (its constructor sleeps: a process slow to start)
    hold_dispatch_file: str = ""            # while this file exists the driver hands out no unit
    crash_rank_after_steps: int = 0         # tensor parallel: the last rank of worker 0's first incarnation
                                            # exits (os._exit) after N steps
    stop_rank_in: str = ""                  # tensor parallel: that rank stops itself (SIGSTOP) while it
                                            # loads ("load"), builds its runner ("build") or after 3 steps ("step")

    def __post_init__(self):
        if self.stop_rank_in not in RANK_PHASES:
            raise ConfigError(f"debug.stop_rank_in: expected one of {list(RANK_PHASES)}, got {self.stop_rank_in!r}")


@dataclass
class RunConfig:
    run_id: str = "demo"                    # output folder name; files depend only on (run id, unit id)
    seed: int = 0                           # per-row generators are seeded from (seed, row id)
    progress: bool = True
    metrics: bool = True                    # live metrics through ray.util.metrics (pipeline/cluster/metrics.py)
    resume: bool = True                     # skip units already committed under this run id
    lease_ttl_s: float = 60                 # a driver's run lease expires this long after its last
                                            # heartbeat (every ttl/4); then another driver may take over

    def __post_init__(self):
        if not RUN_ID.fullmatch(self.run_id):
            raise ConfigError(f"run.run_id: expected 1-128 letters, digits, '.', '_' or '-', starting with "
                              f"a letter or digit (a folder name, no path), got {self.run_id!r}")
        if self.lease_ttl_s < 4:
            raise ConfigError(f"run.lease_ttl_s: expected >= 4, got {self.lease_ttl_s}")


@dataclass
class JobConfig:
    models: ModelsConfig = field(default_factory=ModelsConfig)
    drafting: DraftingConfig = field(default_factory=DraftingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    run: RunConfig = field(default_factory=RunConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def __post_init__(self):
        if self.sampling.response_format is not None:
            from ..engine.grammar.library import check_format    # llguidance: only where a format is set
            try:
                check_format(self.sampling.constraint)      # compiles it (no tokenizer needed)
            except RequestError as e:
                raise ConfigError(f"sampling.{e}") from None
        if self.drafting.uses_draft_model and not self.models.draft:
            raise ConfigError(f"models.draft: required when drafting.method={self.drafting.method!r}")
        if self.models.device.startswith("cuda") and self.cluster.num_gpus_per_worker <= 0:
            raise ConfigError("cluster.num_gpus_per_worker: models.device=cuda needs a GPU per worker (> 0)")


MOVED = {   # keys of an older layout: naming one fails before any work, pointing at its place now
    "models.drafter": "drafting.method",
    "models.hybrid_proposer": "drafting.hybrid_proposer",
    "models.draft_sample_method": "drafting.draft_sample_method",
    "models.ngram_min": "drafting.ngram_min",
    "models.ngram_max": "drafting.ngram_max",
    "models.suffix": "drafting.suffix",
    "engine.num_speculative_tokens": "drafting.num_speculative_tokens",
    "engine.adaptive": "drafting.adaptive",
    **{f"engine.{k}": "engine.kernels (auto | torch)"
       for k in ("packed_linear", "cpu_attention", "cpu_linear", "cpu_fused", "cpu_decoder")},
}


def _moved_keys(tree: dict) -> None:
    for old, new in MOVED.items():
        section, key = old.split(".")
        if isinstance(tree.get(section), dict) and key in tree[section]:
            verb = "was replaced by" if new.startswith("engine.kernels") else "moved to"
            raise ConfigError(f"{old} {verb} {new}")


def load_config(path: str | None = None, overrides: list[str] = (), schema: type = JobConfig) -> JobConfig:
    """YAML file + dotlist overrides -> validated JobConfig (or `schema`, a JobConfig subclass with
    more sections). Raises ConfigError naming the key."""
    try:
        merged = OmegaConf.structured(schema)
        for given in ([OmegaConf.load(path)] if path else []) + [OmegaConf.from_dotlist(list(overrides))]:
            _moved_keys(OmegaConf.to_container(given))
            merged = OmegaConf.merge(merged, given)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e.msg if hasattr(e, "msg") else e).splitlines()[0]
        raise ConfigError(f"{key}: {msg}" if key else msg) from None
    except RequestError as e:         # SamplingParams names the field, not its section
        raise ConfigError(f"sampling.{e}") from None
    except yaml.YAMLError as e:       # override values are YAML: a leading @ or * must be quoted
        bad = next((o for o in overrides if _not_yaml(o)), None)
        where = f"override {bad!r}" if bad else f"config file {path}"
        raise ConfigError(f"{where} is not valid YAML ({str(e).splitlines()[0]}); quote values that start "
                          f"with @ or *, e.g. \"schedule.cron='@daily'\"") from None


def _not_yaml(override: str) -> bool:
    try:
        OmegaConf.from_dotlist([override])
        return False
    except yaml.YAMLError:
        return True


def redacted(cfg: JobConfig) -> dict:
    """The resolved config as stored with the output: credentials removed."""
    tree = asdict(cfg)
    for key in ("key", "secret"):
        if tree["storage"][key] is not None:
            tree["storage"][key] = "<redacted>"
    return tree


# engine keys that do not change the output: which kernels run (the same distribution, rounding-level
# differences at most), copied prompt KV (the same values as computed) and steps run ahead (the same tokens)
ENGINE_NOT_HASHED = ("kernels", "compile", "cuda_graphs", "prefix_reuse", "run_ahead")


def hashed_tree(cfg: JobConfig) -> dict:
    """What determines the output: everything but where and how the job runs (cluster, storage,
    progress display, live metrics, resume, the lease, the CPU kernels) and failure drills."""
    tree = asdict(cfg)
    for key in ("cluster", "storage", "debug"):
        tree.pop(key)
    for key in ("progress", "metrics", "resume", "lease_ttl_s"):
        tree["run"].pop(key)
    for key in ENGINE_NOT_HASHED:
        tree["engine"].pop(key)
    if not tree["input"]["passthrough_columns"]:
        tree["input"].pop("passthrough_columns")
    drafting = tree["drafting"]
    if not cfg.drafting.uses_suffix:
        drafting.pop("suffix")
    if cfg.drafting.method != "hybrid":
        drafting.pop("hybrid_proposer")
    if not cfg.drafting.uses_draft_model:
        drafting.pop("draft_sample_method")
    if not cfg.drafting.free_method == "ngram":
        drafting.pop("ngram_min")
        drafting.pop("ngram_max")
    if tree["models"]["draft_dtype"] == SAME or not cfg.drafting.uses_draft_model:
        tree["models"].pop("draft_dtype")             # `same` is the target's dtype, already hashed
    return tree


def config_hash(cfg: JobConfig) -> str:
    """Stable short hash of hashed_tree (goes into every output row)."""
    return hashlib.sha256(json.dumps(hashed_tree(cfg), sort_keys=True).encode()).hexdigest()[:16]
