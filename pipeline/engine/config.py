"""The engine's configuration: one dataclass per concept, validated once. The job's YAML sections
`engine:` and `drafting:` are these classes (`sampling:` is core/request.py's SamplingParams).

It knows nothing about files, models or Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, one_of

MODES = ("auto", "on", "off")   # a backend switch: auto (where it can run) | on (raise where not) | off
KERNELS = ("auto", "torch")     # auto: our kernels where they build and apply | torch: torch's own only
AUTO = "auto"
DRAFTER_KINDS = ("none", "ngram", "suffix", "draft", "hybrid")
DRAFT_MODEL_KINDS = ("draft", "hybrid")     # the drafters that run a draft model
HYBRID_PROPOSERS = ("ngram", "suffix")
SAMPLE_METHODS = ("greedy", "probabilistic")
MAX_TREE_TOKENS = 62            # a token tree's draft tokens per row: with its root, 63 inputs, whose
                                # visibility bits fit one non-negative int64 (core/tree.py)


def _int_at_least(key: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{key}: expected an integer >= {low}, got {value!r}")


def _switch(value):
    """YAML 1.1 reads a bare on/off as a boolean, which omegaconf hands over as "True"/"False"."""
    return {"True": "on", "False": "off", True: "on", False: "off"}.get(value, value)


@dataclass
class EngineConfig:
    max_num_seqs: Any = AUTO         # running sequences at most (= KV slots per model): an integer >= 1, or
                                     # auto (bounded by the KV memory a slot needs; on CPU then the fewest
                                     # rows near the best tokens/s, measured; model/slots.py, printed)
    max_model_len: int = 2048        # prompt + output tokens per sequence (KV positions per slot)
    max_prefill_tokens: int = 512    # prompt tokens prefilled per step, all new sequences together
    prefix_reuse: bool = True        # a new prompt copies the target KV of its longest prefix some slot holds
                                     # (a running or just-finished sequence's prompt) instead of computing it
    kernels: str = "auto"            # auto: our CPU kernels where they build (attention, fused norm/MLP,
                                     # the decoder loop; linears on the kernel measured fastest per row
                                     # count, backends/cpu/calibrate.py) | torch: torch's own kernels only
    compile: str = "auto"            # compiled FlexAttention over the slot store: auto (where inductor can
                                     # compile, on steps where it is the cheaper kernel) | on | off; on CUDA
                                     # (not off) also each decoder layer compiled (backends/compiled.py)
    cuda_graphs: str = "auto"        # steps replayed as captured CUDA graphs: auto (on CUDA) | on | off
    run_ahead: str = "auto"          # a step without drafts launched before the previous one is read back,
                                     # its input left on the device: auto (where verify steps run in
                                     # captured graphs) | on (raises where they have no graphs) | off

    def __post_init__(self):
        self.compile, self.cuda_graphs, self.run_ahead = map(_switch, (self.compile, self.cuda_graphs,
                                                                        self.run_ahead))
        if self.max_num_seqs != AUTO:
            _int_at_least("engine.max_num_seqs", self.max_num_seqs, 1)
        _int_at_least("engine.max_model_len", self.max_model_len, 2)
        _int_at_least("engine.max_prefill_tokens", self.max_prefill_tokens, 1)
        if not isinstance(self.prefix_reuse, bool):
            raise ConfigError(f"engine.prefix_reuse: expected true or false, got {self.prefix_reuse!r}")
        one_of("engine.kernels", self.kernels, KERNELS)
        one_of("engine.compile", self.compile, MODES)
        one_of("engine.cuda_graphs", self.cuda_graphs, MODES)
        one_of("engine.run_ahead", self.run_ahead, MODES)


@dataclass(frozen=True)
class SuffixParams:
    """The suffix drafter (drafting/suffix_index.py, SuffixTrie.match, states the draft rule)."""
    max_depth: int = 16               # longest indexed substring = match + draft tokens per lookup
    min_match: int = 2                # shortest matched suffix that may draft
    min_prob: float = 0.1             # stop when a draft token's estimated probability falls below
    max_spec_factor: float = 1.0      # a single path: at most factor * match length draft tokens
    max_cached_tokens: int = 32768    # worker-wide index: tokens of finished sequences kept (0: off)
    index_running: bool = True        # the worker-wide index also holds running sequences' text, as committed
    sample_method: str = "probabilistic"   # sampled sequences: draft by sampling the counts (keeps q) | greedy

    def __post_init__(self):
        key = "drafting.suffix."
        if not (isinstance(self.max_depth, int) and 2 <= self.max_depth <= 256):
            raise ConfigError(f"{key}max_depth: expected an integer in [2, 256], got {self.max_depth!r}")
        if not (isinstance(self.min_match, int) and 1 <= self.min_match < self.max_depth):
            raise ConfigError(f"{key}min_match: expected an integer in [1, max_depth), got {self.min_match!r}")
        if not 0 <= self.min_prob <= 1:
            raise ConfigError(f"{key}min_prob: expected a number in [0, 1], got {self.min_prob!r}")
        if not self.max_spec_factor > 0:
            raise ConfigError(f"{key}max_spec_factor: expected a number > 0, got {self.max_spec_factor!r}")
        _int_at_least(f"{key}max_cached_tokens", self.max_cached_tokens, 0)
        if not isinstance(self.index_running, bool):
            raise ConfigError(f"{key}index_running: expected true or false, got {self.index_running!r}")
        one_of(f"{key}sample_method", self.sample_method, SAMPLE_METHODS)


@dataclass(frozen=True)
class TreeParams:
    """Token trees from the suffix and n-gram drafters (drafting/trees.py): several candidate
    continuations per row, verified in one forward."""
    max_tokens: int = 0               # draft tokens per row in a tree, at most (0: a single path), in any
                                      # shape: as deep as the index is confident (num_speculative_tokens
                                      # bounds single paths only); adaptive: sized per step by cost
    max_branches: int = 4             # continuations offered per token, at most
    sampled: bool = False             # suffix trees, rows that sample: draw each token's children from the
                                      # counts without replacement, with q (default: the most frequent)

    def __post_init__(self):
        if not (isinstance(self.max_tokens, int) and 0 <= self.max_tokens <= MAX_TREE_TOKENS):
            raise ConfigError(f"drafting.tree.max_tokens: expected an integer in [0, {MAX_TREE_TOKENS}], "
                              f"got {self.max_tokens!r}")
        _int_at_least("drafting.tree.max_branches", self.max_branches, 1)
        if not isinstance(self.sampled, bool):
            raise ConfigError(f"drafting.tree.sampled: expected true or false, got {self.sampled!r}")


@dataclass
class DraftingConfig:
    """What proposes draft tokens and how many."""
    method: str = "ngram"                    # none | ngram | suffix | draft | hybrid
    num_speculative_tokens: int = 4          # draft length g (the maximum, when adaptive)
    adaptive: bool = True                    # per-sequence g from its acceptance and measured costs; may be 0
    hybrid_proposer: str = "ngram"           # hybrid's free first part: ngram | suffix
    draft_sample_method: str = "greedy"      # draft model: greedy (token only, one-hot q) | probabilistic (keeps q)
    ngram_min: int = 2                       # shortest suffix n-gram looked up
    ngram_max: int = 4                       # longest suffix n-gram looked up
    suffix: SuffixParams = field(default_factory=SuffixParams)   # method suffix (or hybrid's first part)
    tree: TreeParams = field(default_factory=TreeParams)         # methods ngram and suffix: token trees
    forced_tokens: bool = True               # rows with a response_format: propose the tokens their grammar
                                             # forces as drafts at no draft cost (any method, none included)

    def __post_init__(self):
        one_of("drafting.method", self.method, DRAFTER_KINDS)
        if not isinstance(self.forced_tokens, bool):
            raise ConfigError(f"drafting.forced_tokens: expected true or false, got {self.forced_tokens!r}")
        one_of("drafting.hybrid_proposer", self.hybrid_proposer, HYBRID_PROPOSERS)
        one_of("drafting.draft_sample_method", self.draft_sample_method, SAMPLE_METHODS)
        _int_at_least("drafting.num_speculative_tokens", self.num_speculative_tokens, 0)
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"drafting.adaptive: expected true or false, got {self.adaptive!r}")
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int)
                and 1 <= self.ngram_min <= self.ngram_max):
            raise ConfigError(f"drafting.ngram_min/ngram_max: expected 1 <= min <= max, "
                              f"got {self.ngram_min}, {self.ngram_max}")
        self._check_trees()

    def _check_trees(self) -> None:
        """Token trees where a drafter grows them, never a setting that would be silently ignored."""
        tree = self.tree
        if tree.max_tokens and self.method not in HYBRID_PROPOSERS:
            raise ConfigError(f"drafting.tree.max_tokens: token trees are drafted by drafting.method ngram or "
                              f"suffix, got drafting.method={self.method!r} with drafting.tree.max_tokens="
                              f"{tree.max_tokens}; set drafting.tree.max_tokens=0 for single paths")
        if tree.sampled and not (self.method == "suffix" and tree.max_tokens):
            raise ConfigError(f"drafting.tree.sampled: draws suffix trees' children from the index's counts, so it "
                              f"needs drafting.method=suffix and drafting.tree.max_tokens > 0, got drafting.method="
                              f"{self.method!r} with drafting.tree.max_tokens={tree.max_tokens}")

    @property
    def uses_draft_model(self) -> bool:
        return self.method in DRAFT_MODEL_KINDS

    @property
    def uses_suffix(self) -> bool:
        return self.method == "suffix" or (self.method == "hybrid" and self.hybrid_proposer == "suffix")

    @property
    def free_method(self) -> str | None:
        """The model-free drafter in use (ngram | suffix; alone or as hybrid's first part), or None."""
        if self.method == "hybrid":
            return self.hybrid_proposer
        return self.method if self.method in HYBRID_PROPOSERS else None
