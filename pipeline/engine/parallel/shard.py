"""Which part of each weight a tensor-parallel rank holds, and the model made that part.

Megatron's split of a decoder (the one transformers' `base_model_tp_plan` lists for these families):

    q/k/v    column-parallel by heads: rank r computes its query heads and the KV heads they read
    o        row-parallel: each rank's heads give a partial sum, all-reduced once per attention
    gate/up  column-parallel by the MLP's width; down row-parallel, all-reduced once per MLP
    lm_head  split by vocabulary; the full logits gathered on rank 0 (penalties, top-k/p, min-p,
             grammar masks and the verify rule read the whole distribution)
    the rest (embeddings, norms, RoPE) replicated

With fewer KV heads than ranks (GQA), each rank keeps the one KV head its query heads read (that needs
ranks / kv_heads whole). A model that cannot be split so is refused naming the key and its numbers.
Row-parallel biases stay on rank 0 only, so the all-reduce adds them once.

`Split.slice_of` names a weight's part by its checkpoint name (the loader reads only that slice);
`shard_model` cuts a model loaded whole the same way; `install_collectives` adds the all-reduces and
the gather to the modules that run after the runner has put its kernels in place, so those kernels
run on the shards. Knows nothing about requests, files or Ray.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
KEY = "models.tensor_parallel_size"
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Split:
    """Rank `rank`'s part of a model of these sizes split over `size` ranks."""
    size: int
    rank: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, cfg, size: int, rank: int = 0) -> "Split":
        """The split of a (text) config over `size` ranks; ValueError naming the key and the model's
        numbers where it cannot be split."""
        model_type = getattr(cfg, "model_type", None)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        split = cls(size, rank, cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads,
                    head_dim, cfg.intermediate_size, cfg.vocab_size)
        if size == 1:
            return split
        if model_type not in FAMILIES:
            raise ValueError(f"{KEY}={size}: tensor parallel splits the {', '.join(FAMILIES)} families; "
                             f"this model is {model_type!r}")
        for what, n in (("num_attention_heads", split.heads), ("intermediate_size", split.intermediate),
                        ("vocab_size", split.vocab)):
            if n % size:
                raise ValueError(f"{KEY}={size}: the model's {what} {n} is not divisible by {size} "
                                 f"(choose a size that divides it)")
        kv = split.kv_heads
        if kv % size and size % kv:
            raise ValueError(f"{KEY}={size}: the model's num_key_value_heads {kv} neither divides into nor "
                             f"is a divisor of {size} ranks (each rank must hold whole KV heads)")
        return split

    @property
    def q(self) -> range:
        """This rank's query heads."""
        n = self.heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv(self) -> range:
        """This rank's KV heads: its share, or the one head its queries read (fewer KV heads than ranks)."""
        if self.kv_heads >= self.size:
            n = self.kv_heads // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        head = self.rank * self.kv_heads // self.size
        return range(head, head + 1)

    @property
    def mlp(self) -> range:
        n = self.intermediate // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def vocab_part(self) -> range:
        n = self.vocab // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(axis, start, stop) of checkpoint tensor `name` this rank holds; None: all of it (replicated,
        or a row-parallel bias, which `keeps_bias` says whether this rank adds)."""
        if self.size == 1:
            return None
        hd = self.head_dim
        heads = lambda r: (r.start * hd, r.stop * hd)
        parts = {"self_attn.q_proj": (0, *heads(self.q)), "self_attn.k_proj": (0, *heads(self.kv)),
                 "self_attn.v_proj": (0, *heads(self.kv)), "mlp.gate_proj": (0, self.mlp.start, self.mlp.stop),
                 "mlp.up_proj": (0, self.mlp.start, self.mlp.stop)}
        module, _, kind = name.rpartition(".")
        for suffix, part in parts.items():
            if module.endswith(suffix):
                return part
        if kind == "weight" and module.endswith("self_attn.o_proj"):
            return (1, *heads(self.q))
        if kind == "weight" and module.endswith("mlp.down_proj"):
            return (1, self.mlp.start, self.mlp.stop)
        if module == "lm_head" and kind == "weight":
            return (0, self.vocab_part.start, self.vocab_part.stop)
        return None

    def zeroes(self, name: str) -> bool:
        """Whether this rank holds `name` as zeros: a row-parallel bias, added on rank 0 only."""
        module, _, kind = name.rpartition(".")
        return self.size > 1 and self.rank > 0 and kind == "bias" and module.endswith(ROW_PARALLEL)

    def localize(self, cfg) -> None:
        """The rank's sizes into its model's (text) config, in place: heads, KV heads, MLP width (the
        runner sizes its slot store and kernels from them); the vocabulary stays whole (the logits are)."""
        cfg.head_dim = self.head_dim
        cfg.num_attention_heads = len(self.q)
        cfg.num_key_value_heads = len(self.kv)
        cfg.intermediate_size = len(self.mlp)
        cfg.tensor_parallel = {"size": self.size, "rank": self.rank}

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.size}: query heads {self.q.start}-{self.q.stop - 1}, KV heads "
                f"{self.kv.start}-{self.kv.stop - 1}, MLP {self.mlp.start}-{self.mlp.stop - 1}, vocabulary "
                f"{self.vocab_part.start}-{self.vocab_part.stop - 1}")


def decoder_config(model: nn.Module):
    """The model's decoder config (a multimodal model's text part; the config itself otherwise)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def shard_model(model: nn.Module, split: Split) -> nn.Module:
    """Cut a model loaded whole to `split`'s part, in place (tied embeddings are untied: the LM head
    keeps its vocabulary part, the embedding stays whole). Returns the model."""
    if split.size == 1:
        return model
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        part = split.slice_of(name)
        if part is None and not split.zeroes(name):
            continue
        data = (torch.zeros_like(param) if part is None
                else param.detach().narrow(part[0], part[1], part[2] - part[1]).clone())
        set_parameter(model, name, data)
    localize_model(model, split)
    return model


def set_parameter(model: nn.Module, name: str, data: torch.Tensor) -> None:
    """Parameter `name` of `model` becomes `data` (a linear's sizes follow its weight's)."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, nn.Parameter(data, requires_grad=False))
    if isinstance(module, nn.Linear) and attr == "weight":
        module.out_features, module.in_features = data.shape


def localize_model(model: nn.Module, split: Split) -> None:
    """The model's config and attention modules told their rank's sizes (after its weights are cut)."""
    split.localize(decoder_config(model))
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
    groups = len(split.q) // len(split.kv)
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = groups


def install_collectives(model: nn.Module, group) -> int:
    """The replica's collectives on the modules that run now: each attention's and MLP's output
    all-reduced (their last linears are row-parallel), the LM head's logits gathered on rank 0.
    Idempotent (a model whose runner is rebuilt keeps one set). Returns the hooks installed."""
    for handle in getattr(model, "_tp_hooks", ()):
        handle.remove()
    hooks = []

    def reduce_first(module, args, out):
        group.all_reduce(out[0])
        return out

    def reduce(module, args, out):
        return group.all_reduce(out)

    def gather(module, args, out):
        return group.gather_last(out)
    for layer in model.model.layers:
        hooks.append(layer.self_attn.register_forward_hook(reduce_first))
        hooks.append(layer.mlp.register_forward_hook(reduce))
    hooks.append(model.get_output_embeddings().register_forward_hook(gather))
    model._tp_hooks = hooks
    return len(hooks)
