"""What the engine reads from a Hugging Face model config: features its attention must implement.

It knows nothing about files, loading or the slot store.
"""

from __future__ import annotations


def text_config(config):
    """The decoder's own config (a multimodal model's text part; the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_dim(config) -> int:
    """Size of one attention head: `head_dim` where the config sets it, else hidden size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


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


def reject_unsupported(config, max_model_len: int) -> None:
    """Raise ValueError for model features the engine's attention does not implement."""
    window = active_sliding_window(config)
    if window is not None and window < max_model_len:
        raise ValueError(
            f"{type(config).__name__} uses sliding-window attention (sliding_window={window}) shorter "
            f"than max_model_len={max_model_len}; the engine's attention does not implement it. "
            f"Lower max_model_len to <= {window} or use a model without a sliding window."
        )

