"""Typed job configuration: dataclasses composed by omegaconf structured configs.

YAML files in configs/ plus dotlist overrides (`engine.max_num_seqs=32`). Unknown keys and bad
values fail here, before any model is loaded, naming the key. Each component receives only its own
sub-config (models, engine, sampling, input, output, run).

This module knows nothing about models, Ray or files beyond reading the YAML it is given.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .engine.engine import EngineConfig
from .engine.request import SamplingParams

DRAFTER_KINDS = ("none", "ngram", "draft", "hybrid")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    pass


@dataclass
class ModelsConfig:
    target: str = "smollm2-135m-instruct"   # shipped model name, .gguf file, or HF directory (safetensors)
    draft: Optional[str] = None              # draft model (same tokenizer) for drafter draft/hybrid
    drafter: str = "ngram"                   # none | ngram | draft | hybrid
    draft_sample_method: str = "greedy"      # greedy (token only, one-hot q) | probabilistic (keeps q)
    ngram_min: int = 2                       # shortest suffix n-gram looked up
    ngram_max: int = 4                       # longest suffix n-gram looked up
    dtype: str = "bfloat16"                  # float32 | bfloat16 | float16
    device: str = "cpu"                      # cpu | cuda | cuda:N
    trust_remote_code: bool = False          # never run model code from a checkpoint unless set

    def __post_init__(self):
        _one_of("models.drafter", self.drafter, DRAFTER_KINDS)
        _one_of("models.draft_sample_method", self.draft_sample_method, ("greedy", "probabilistic"))
        _one_of("models.dtype", self.dtype, DTYPES)
        if self.drafter in ("draft", "hybrid") and not self.draft:
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

    def __post_init__(self):
        try:
            self.to_engine_config()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def to_engine_config(self) -> EngineConfig:
        return EngineConfig(**asdict(self))


@dataclass
class InputConfig:
    path: str = "data/demo_prompts.jsonl"   # JSONL or Parquet of prompts
    prompt_column: str = "prompt"           # a plain string prompt (chat template applied)
    messages_column: str = "messages"       # or a chat: list of {role, content}
    id_column: str = "id"                   # optional; else the row index
    limit: Optional[int] = None             # read at most this many rows


@dataclass
class OutputConfig:
    path: str = "out/demo"                  # folder for completions and rounds


@dataclass
class RunConfig:
    run_id: str = "demo"
    seed: int = 0                           # per-row generators are seeded from (seed, row id)
    progress: bool = True


@dataclass
class JobConfig:
    models: ModelsConfig = field(default_factory=ModelsConfig)
    engine: EngineSection = field(default_factory=EngineSection)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    run: RunConfig = field(default_factory=RunConfig)


def _one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: expected one of {list(allowed)}, got {value!r}")


def load_config(path: str | None = None, overrides: list[str] = ()) -> JobConfig:
    """YAML file + dotlist overrides -> validated JobConfig. Raises ConfigError naming the key."""
    try:
        merged = OmegaConf.structured(JobConfig)
        if path:
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e.msg if hasattr(e, "msg") else e).splitlines()[0]
        raise ConfigError(f"{key}: {msg}" if key else msg) from None


def config_hash(cfg: JobConfig) -> str:
    """Stable short hash of the resolved config (goes into every output row)."""
    return hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:16]
