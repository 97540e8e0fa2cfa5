"""What the engine reads from a Hugging Face model config: the families it serves, and the features its
attention must compute.

It knows nothing about files, loading or the slot store.
"""

from __future__ import annotations

from dataclasses import dataclass


def text_config(config):
    """The decoder's own config (a multimodal model's text part; the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_dim(config) -> int:
    """Size of one attention head: `head_dim` where the config sets it, else hidden size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config) -> int:
    """Key/value heads per layer: `num_key_value_heads` where the config sets it, else one per query
    head (GPT-2, GPT-J, GPT-NeoX, Phi configs name no KV heads)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def active_sliding_window(config) -> int | None:
    """The sliding window some attention layer really applies, or None.

    Qwen2 keeps `sliding_window` only when `use_sliding_window`, and applies it only to layers marked
    "sliding_attention" in `layer_types` (those at or past max_window_layers); Mistral-style configs
    have no flag and apply a non-null window to every layer.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or not getattr(config, "use_sliding_window", True):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


# The decoder families (text config `model_type`) the engine serves, each run greedy token-identical to
# Hugging Face's eager reference on every forward path that applies (tests/engine/test_families.py);
# any other model type is refused at load: what a family's layers compute is not assumed.
CHECKED_FAMILIES = (
    "arcee", "cohere", "cohere2", "ernie4_5", "exaone4", "falcon", "gemma", "gemma2", "gemma3_text", "glm", "glm4",
    "gpt2", "gpt_bigcode", "gpt_neox", "gpt_oss", "gptj", "granite", "granitemoe", "llama", "mistral", "mixtral",
    "nemotron", "olmo", "olmo2", "olmo3", "persimmon", "phi", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
    "seed_oss", "smollm3", "stablelm", "starcoder2")
# Families transformers ships that the engine refuses, and why
REFUSED = {
    "bloom": "ALiBi position biases, which no attention path of the engine adds",
    "mpt": "ALiBi position biases, which no attention path of the engine adds",
    "deepseek_v2": "multi-head latent attention: its keys and values are not the heads x head_dim its config names",
    "deepseek_v3": "multi-head latent attention: its keys and values are not the heads x head_dim its config names",
}

# Config fields of checked families (or of any family's config) that change what attention computes in
# ways the engine does not: set (truthy), the model is refused
UNCOMPUTED_FIELDS = {
    "alibi": "ALiBi position biases, which no attention path of the engine adds",
    "use_alibi": "ALiBi position biases, which no attention path of the engine adds",
    "attention_chunk_size": "chunked local attention, which no attention path of the engine computes",
}


def reject_unsupported(config) -> None:
    """Raise ValueError, naming the family and the reason, for a model the engine does not serve exactly:
    a model type outside CHECKED_FAMILIES, or a config setting a field of UNCOMPUTED_FIELDS (Falcon's
    ALiBi variant)."""
    cfg = text_config(config)
    family = getattr(cfg, "model_type", None) or type(cfg).__name__
    if family in REFUSED:
        raise ValueError(f"model type {family!r} is not supported: {REFUSED[family]}")
    if family not in CHECKED_FAMILIES:
        raise ValueError(f"model type {family!r} is not among the families the engine is checked against "
                         f"({', '.join(CHECKED_FAMILIES)}): its layers may compute what the engine does not. "
                         f"Use a model of a listed family")
    for field, what in UNCOMPUTED_FIELDS.items():
        if getattr(cfg, field, None):
            raise ValueError(f"model type {family!r} with {field}={getattr(cfg, field)!r} is not supported: {what}")


@dataclass(frozen=True)
class AttentionFeatures:
    """What a model's attention computes beyond softmax(q k^T * scale + causal mask) v, as the engine
    serves it: the padded path (model/attention.py) computes each, FlexAttention (backends/flex.py)
    each but sinks; our CPU kernel and the CPU decoder loop none: a model takes the paths that compute
    all of its features."""
    softcap: float | None = None     # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    sinks: bool = False              # a learned logit per head in the softmax's sum, attending to nothing (gpt-oss)
    window: int | None = None        # sliding window shorter than max_model_len, on `windowed` of `layers`
    windowed: int = 0
    layers: int = 0

    def __bool__(self) -> bool:
        return self.softcap is not None or self.sinks or self.window is not None

    def describe(self) -> str:
        parts = ([f"soft-cap {self.softcap:g}"] if self.softcap is not None else []) + (["sinks"] if self.sinks else [])
        if self.window is not None:
            parts.append(f"sliding window {self.window} on {self.windowed} of {self.layers} layers")
        return ", ".join(parts)


def attention_features(model, max_model_len: int) -> AttentionFeatures:
    """The features of `model`'s attention (AttentionFeatures) at this max_model_len: a sliding window
    counts where it is shorter (at or past it, every key a row can have is within it)."""
    cfg = text_config(model.config)
    window = active_sliding_window(cfg)
    if window is not None and window >= max_model_len:
        window = None
    layer_types = getattr(cfg, "layer_types", None)
    windowed = (0 if window is None else
                sum(t == "sliding_attention" for t in layer_types) if layer_types else cfg.num_hidden_layers)
    from torch import nn                       # (here: the driver reads configs without importing torch)
    sinks = any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in model.modules())
    return AttentionFeatures(getattr(cfg, "attn_logit_softcapping", None), sinks, window, windowed,
                             cfg.num_hidden_layers)
