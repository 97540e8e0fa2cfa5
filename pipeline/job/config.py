"""Typed job configuration: dataclasses composed by omegaconf structured configs.

YAML files in configs/ plus dotlist overrides (`engine.max_num_seqs=32`). Unknown keys and bad
values fail here, before any model is loaded, naming the key. Each component receives only its own
sub-config (models, engine, sampling, input, output, run).

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

from ..engine.core.request import SamplingParams
from ..engine.drafting.suffix import SuffixParams
from ..engine.engine import EngineConfig
from ..errors import ConfigError, one_of
from ..io.reader import InputConfig
from ..io.storage import StorageConfig
from ..loading.hardware import AUTO, EXPLICIT_DTYPES

DRAFTER_KINDS = ("none", "ngram", "suffix", "draft", "hybrid")
DRAFT_MODEL_KINDS = ("draft", "hybrid")     # the drafters that load models.draft
HYBRID_PROPOSERS = ("ngram", "suffix")
DTYPES = (AUTO, *EXPLICIT_DTYPES)
SAME = "same"
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass
class SuffixSection:
    """The suffix drafter (engine/suffix.py states the draft rule)."""
    max_depth: int = 16               # longest indexed substring = match + draft tokens per lookup
    min_match: int = 2                # shortest matched suffix that may draft
    min_prob: float = 0.1             # stop when a draft token's estimated probability falls below
    max_spec_factor: float = 1.0      # at most factor * match length draft tokens
    max_cached_tokens: int = 32768    # worker-wide index over finished sequences, oldest evicted (0: off)
    index_running: bool = True        # the worker-wide index also holds running sequences' text as committed
    sample_method: str = "probabilistic"   # sampled sequences draft by sampling the counts (q kept) | greedy

    def __post_init__(self):
        try:
            self.to_params()
        except ValueError as e:
            raise ConfigError(f"models.suffix.{e}") from None

    def to_params(self) -> SuffixParams:
        return SuffixParams(**asdict(self))


@dataclass
class ModelsConfig:
    target: str = "smollm2-135m-instruct"   # shipped model name, .gguf file, or HF directory (safetensors)
    draft: Optional[str] = None              # draft model (same tokenizer) for drafter draft/hybrid
    drafter: str = "ngram"                   # none | ngram | suffix | draft | hybrid
    hybrid_proposer: str = "ngram"           # hybrid's free first part: ngram | suffix
    draft_sample_method: str = "greedy"      # greedy (token only, one-hot q) | probabilistic (keeps q)
    ngram_min: int = 2                       # shortest suffix n-gram looked up
    ngram_max: int = 4                       # longest suffix n-gram looked up
    suffix: SuffixSection = field(default_factory=SuffixSection)   # drafter suffix (or hybrid's first part)
    dtype: str = AUTO                        # auto (each worker picks for its hardware: pipeline/hardware.py)
                                             # | float32 | bfloat16 | float16
    draft_dtype: str = AUTO                  # the draft model's: auto (what this hardware runs fastest, as
                                             # for dtype) | same (the target's) | float32 | bfloat16 | float16.
                                             # Its precision changes which tokens are proposed, never the
                                             # output distribution (the verifier corrects against the draft's
                                             # own q): a bf16 draft beside a forced fp32 target costs half
    device: str = "cpu"                      # cpu | cuda | cuda:N
    trust_remote_code: bool = False          # never run model code from a checkpoint unless set

    def __post_init__(self):
        one_of("models.drafter", self.drafter, DRAFTER_KINDS)
        one_of("models.hybrid_proposer", self.hybrid_proposer, HYBRID_PROPOSERS)
        one_of("models.draft_sample_method", self.draft_sample_method, ("greedy", "probabilistic"))
        one_of("models.dtype", self.dtype, DTYPES)
        one_of("models.draft_dtype", self.draft_dtype, (SAME, *DTYPES))
        if uses_draft_model(self) and not self.draft:
            raise ConfigError(f"models.draft: required when models.drafter={self.drafter!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"models.ngram_min/ngram_max: expected 1 <= min <= max, "
                              f"got {self.ngram_min}, {self.ngram_max}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"models.device: expected cpu, cuda or cuda:N, got {self.device!r}")


@dataclass
class SamplingConfig:
    """Defaults for every row; rows may override some of them (see the input contract)."""
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        try:
            self.to_params()
        except ValueError as e:
            raise ConfigError(f"sampling.{e}") from None

    def to_params(self, **overrides) -> SamplingParams:
        values = {**asdict(self), **overrides}
        values["stop"] = tuple(values["stop"])
        return SamplingParams(**values)


@dataclass
class EngineSection:
    max_num_seqs: int = 16
    max_model_len: int = 2048
    num_speculative_tokens: int = 4
    adaptive: bool = False
    max_prefill_tokens: int = 512
    packed_linear: bool = True      # CPU: regroup linear weights once for a faster kernel (cpu_linear's,
                                    # else oneDNN's); false: torch's F.linear (ignored on CUDA)
    compile: str = "auto"           # auto | on | off: compiled FlexAttention, each row reading only its
                                    # own KV blocks (auto: where inductor can compile, on steps where that
                                    # beats padding every row to the longest; on: every step; off: eager),
                                    # for the forwards our CPU kernel does not take (cpu_attention below)
    cpu_attention: str = "auto"     # auto | on | off: attention on CPU by our C kernel, each row its own keys
                                    # (pipeline/engine/cpu_attention.py; fp32/bf16, built at first use with
                                    # the system C compiler; auto: where it builds, else torch's kernels)
    cpu_linear: str = "auto"        # auto | on | off: with packed_linear, linears on CPU by our C panel
                                    # kernel, fp32/bf16 (pipeline/engine/cpu_linear.py; off, or auto where it
                                    # cannot build: oneDNN-packed weights)
    cpu_fused: str = "auto"         # auto | on | off: RMSNorm and the MLP's silu(gate) * up on CPU as one
                                    # pass each, gate and up as one linear (pipeline/engine/cpu_fused.py;
                                    # off, or auto where it cannot build: the model's own modules)
    cpu_decoder: str = "auto"       # auto | on | off: on CPU with the three kernels above in use, the
                                    # model's forward as one loop over them, RoPE and the KV write in one
                                    # pass, q/k/v as one linear (pipeline/engine/cpu_decoder.py; Llama,
                                    # Qwen2/3, Mistral families; off, or auto elsewhere: the model's forward)
    prefix_reuse: bool = True       # a new prompt copies the target's KV for the longest prefix it shares
                                    # with a running or just-finished prompt instead of computing it
                                    # (pipeline/engine/prefix.py): templates, system prompts, repeated samples
    cuda_graphs: str = "auto"       # auto | on | off: on a GPU, decoding and verify steps replayed as captured
                                    # CUDA graphs, one per padded shape, captured on first use and checked
                                    # against an uncaptured run (pipeline/engine/cuda_graphs.py; auto: on
                                    # CUDA; on: fail elsewhere; off: every kernel launched from Python)

    def __post_init__(self):
        # YAML 1.1 reads a bare on/off as a boolean, which omegaconf hands over as "True"/"False"
        for name in ("compile", "cpu_attention", "cpu_linear", "cpu_fused", "cpu_decoder", "cuda_graphs"):
            value = getattr(self, name)
            setattr(self, name, {"True": "on", "False": "off"}.get(value, value))
        try:
            self.to_engine_config()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def to_engine_config(self) -> EngineConfig:
        return EngineConfig(**asdict(self))


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
    load_timeout_s: float = 900             # a placed actor's model load must finish by then
    stall_timeout_s: float = 600            # a worker holding units with no engine step or commit for
                                            # this long is taken as hung: killed, its units re-queued
    shutdown_grace_s: float = 30            # on SIGINT/SIGTERM, how long in-flight units may still commit

    def __post_init__(self):
        for key, low in (("num_workers", 1), ("units_in_flight", 1), ("max_unit_attempts", 1),
                         ("max_worker_restarts", 0), ("placement_timeout_s", 1), ("load_timeout_s", 1),
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
    engine: EngineSection = field(default_factory=EngineSection)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    run: RunConfig = field(default_factory=RunConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def __post_init__(self):
        if self.models.device.startswith("cuda") and self.cluster.num_gpus_per_worker <= 0:
            raise ConfigError("cluster.num_gpus_per_worker: models.device=cuda needs a GPU per worker (> 0)")


def load_config(path: str | None = None, overrides: list[str] = (), schema: type = JobConfig) -> JobConfig:
    """YAML file + dotlist overrides -> validated JobConfig (or `schema`, a JobConfig subclass with
    more sections). Raises ConfigError naming the key."""
    try:
        merged = OmegaConf.structured(schema)
        if path:
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e.msg if hasattr(e, "msg") else e).splitlines()[0]
        raise ConfigError(f"{key}: {msg}" if key else msg) from None
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


def uses_draft_model(models: ModelsConfig) -> bool:
    return models.drafter in DRAFT_MODEL_KINDS


def uses_suffix(models: ModelsConfig) -> bool:
    return models.drafter == "suffix" or (models.drafter == "hybrid" and models.hybrid_proposer == "suffix")


def redacted(cfg: JobConfig) -> dict:
    """The resolved config as stored with the output: credentials removed."""
    tree = asdict(cfg)
    for key in ("key", "secret"):
        if tree["storage"][key] is not None:
            tree["storage"][key] = "<redacted>"
    return tree


def hashed_tree(cfg: JobConfig) -> dict:
    """What determines the output: everything but where and how the job runs (cluster, storage,
    progress display, live metrics, resume, the lease, the CPU kernels) and failure drills."""
    tree = asdict(cfg)
    for key in ("cluster", "storage", "debug"):
        tree.pop(key)
    for key in ("progress", "metrics", "resume", "lease_ttl_s"):
        tree["run"].pop(key)
    tree["engine"].pop("compile")                     # the attention kernels: same distribution either way
    tree["engine"].pop("cpu_attention")
    tree["engine"].pop("cpu_linear")                  # the linear kernel: likewise (rounding-level differences)
    tree["engine"].pop("cpu_fused")                   # the fused norm / MLP kernels: likewise
    tree["engine"].pop("cpu_decoder")                 # the kernel loop: the same numbers as the modules
    tree["engine"].pop("prefix_reuse")                # copied prompt KV: the same values as computed
    tree["engine"].pop("cuda_graphs")                 # a replayed step: the same kernels as launched
    if not tree["input"]["passthrough_columns"]:      # runs recorded before the key existed still resume
        tree["input"].pop("passthrough_columns")
    models = tree["models"]                           # likewise for runs without the suffix drafter
    if models["hybrid_proposer"] == "ngram":
        models.pop("hybrid_proposer")
    if models["draft_dtype"] == SAME or not uses_draft_model(cfg.models):
        models.pop("draft_dtype")                     # `same`: the only behaviour before the key existed
    if not uses_suffix(cfg.models):
        models.pop("suffix")
    elif models["suffix"]["sample_method"] == "greedy":   # the rule before the key existed
        models["suffix"].pop("sample_method")
    return tree


def config_hash(cfg: JobConfig) -> str:
    """Stable short hash of hashed_tree (goes into every output row)."""
    return hashlib.sha256(json.dumps(hashed_tree(cfg), sort_keys=True).encode()).hexdigest()[:16]
