"""Runs a Hugging Face decoder (Llama, Qwen2/3, Mistral, SmolLM...) over a slot KV store.

One ModelRunner per model (target, draft). A forward takes a ragged batch: for each row a slot, the
position of its first new token, and its new tokens. Tokens are packed flat, so a verify step costs
the sum of the rows' lengths, not batch x the longest. The runner counts every real token
it forwards, so tests can prove accepted tokens are never recomputed.

This module knows nothing about requests, drafting or sampling.
"""
from __future__ import annotations

import inspect

import torch

from ..backends.cpu.attention import policy as cpu_attention_policy
from ..backends.cpu.decoder import policy as cpu_decoder_policy
from ..backends.cpu.fused import fuse
from ..backends.cpu.fused import policy as cpu_fused_policy
from ..backends.cpu.linear import can_pack, pack_linears, panel_linears
from ..backends.cpu.linear import policy as cpu_linear_policy
from ..backends.cuda.graphs import UNCAPTURED, CudaCapture, StepGraphs
from ..backends.cuda.graphs import policy as cuda_graphs_policy
from ..backends.flex import BLOCK, block_tables, capacity, flex_unavailable, prefer_flex
from ..config import MODES
from ..kv.layout import attention_masks, make_layout
from ..kv.store import SlotKVCache
from .attention import ATTENTION_NAME, register_attention
from .hf_config import active_sliding_window


def flex_policy(compile_mode: str, device: torch.device) -> str | None:
    """When a runner takes the compiled FlexAttention path: "always" (engine.compile=on; raises where
    it cannot compile), "cheaper" (auto: on steps where flex.prefer_flex says so, wherever it can
    compile), or None (off, or auto where it cannot: the eager padded-SDPA path)."""
    if compile_mode not in MODES:
        raise ValueError(f"engine.compile: expected one of {MODES}, got {compile_mode!r}")
    if compile_mode == "off":
        return None
    reason = flex_unavailable(device)
    if reason is not None and compile_mode == "on":
        raise RuntimeError(f"engine.compile=on, but FlexAttention cannot be compiled on {device}: {reason}")
    if reason is not None:
        return None
    return "always" if compile_mode == "on" else "cheaper"


def cache_kwarg(model) -> str:
    """The keyword a model's forward takes its KV cache by: `cache` (transformers >= 5.2x) or
    `past_key_values` (earlier releases, e.g. 5.17, which ignore an unknown `cache`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class ModelRunner:
    def __init__(self, model, num_slots: int, max_model_len: int, pack_linear: bool = True,
                 compile: str = "off", cpu_attention: str = "auto", cpu_linear: str = "auto",
                 cpu_fused: str = "auto", cpu_decoder: str = "auto", cuda_graphs: str = "off"):
        cfg = _text_config(model.config)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = cfg.vocab_size
        self.num_groups = cfg.num_attention_heads // cfg.num_key_value_heads
        # flex: attention per row over its own key blocks (flex.py), always or on steps where that is
        # cheaper than padded SDPA (kv_cache.py), which is every other step's kernel
        self.flex = flex_policy(compile, self.device)
        # on CPU: our C attention kernel (cpu_attention.py), each row reading its own keys; None where
        # it is off or cannot be used (then flex or padded SDPA, as above)
        self.cpu_attention = cpu_attention_policy(cpu_attention, self.device, self.dtype, head_dim)
        # CUDA graphs (cuda_graphs.py): UNCAPTURED runs their padded forward without capturing, which is
        # how the tests check it on CPU. The graphs' pad rows and tokens need one spare slot and a few
        # positions past max_model_len.
        capture = cuda_graphs != UNCAPTURED and cuda_graphs_policy(cuda_graphs, self.device)
        graphs = capture or cuda_graphs == UNCAPTURED
        store_slots = StepGraphs.store_rows(num_slots) if graphs else num_slots
        store_len = StepGraphs.store_positions(max_model_len) if graphs else max_model_len
        self.cache = SlotKVCache(cfg.num_hidden_layers, store_slots, cfg.num_key_value_heads,
                                 capacity(store_len) if self.flex else store_len,
                                 head_dim, self.dtype, self.device)
        self.num_forward_tokens = 0        # real tokens forwarded, all time
        self.cache_kwarg = cache_kwarg(model)
        # On CPU: RMSNorms and SiLU MLPs as one pass each, gate and up as one linear (cpu_fused.py), before
        # the linears are swapped below (the merged gate/up is a plain nn.Linear). Mutates the model.
        self.cpu_fused = cpu_fused_policy(cpu_fused, self.device, self.dtype)
        self.fused_norms, self.fused_mlps = fuse(model, self.cpu_fused) if self.cpu_fused is not None else (0, 0)
        # On CPU, regroup the linear weights once for our panel kernel (fp32 or bf16), else reorder them for
        # oneDNN: a decoding step then streams the weights at memory speed, and verifying a few tokens
        # per sequence costs little more than one (see cpu_linear.py). Mutates the model in place.
        # pack_linear=False leaves the model's linears alone (torch's F.linear).
        self.cpu_linear = cpu_linear_policy(cpu_linear, self.device, self.dtype) if pack_linear else None
        self.panel_linears = panel_linears(model, self.cpu_linear) if self.cpu_linear is not None else 0
        self.packed_linears = (pack_linears(model) if not self.panel_linears and pack_linear
                               and can_pack(self.device, self.dtype) else 0)
        # Route attention through the slot store. Calls without `slot_step` (e.g. HF generate on the
        # same model object) fall through to SDPA, so the model stays usable elsewhere.
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        # On CPU with all of the above in place: the forward as one loop over those kernels, RoPE and the
        # KV write in one pass, q/k/v as one linear (cpu_decoder.py); the same numbers as the model's
        # forward, without its glue. Merges q/k/v's panels in place (the modules keep views).
        self.decoder = cpu_decoder_policy(cpu_decoder, model, self.cache, self.cpu_attention, self.cpu_fused,
                                          self.cpu_linear if self.panel_linears else None, max_model_len,
                                          active_sliding_window(model.config))
        # The graphs replay the model's forward with torch's padded attention: not where our CPU kernels
        # (or the CPU loop over them) take every forward.
        self.graphs = (StepGraphs(self._model_forward, self.num_groups, self.dtype, self.device, num_slots,
                                  self.cache.max_len, CudaCapture(self.device) if capture else None)
                       if graphs and self.decoder is None and self.cpu_attention is None else None)

    @torch.inference_mode()
    def forward(self, slots: list[int], starts: list[int], tokens: list[list[int]],
                logits: str = "all") -> torch.Tensor | None:
        """Compute KV for tokens[b] at positions starts[b]... of slot slots[b]. Returns float logits for
        every real token in row order ([sum(len), vocab]), for the last token of each row
        ([rows, vocab]), or None (logits="none": prefill)."""
        num_new = [len(t) for t in tokens]
        kernel = self.cpu_attention
        bucket = self.graphs.bucket(starts, num_new, logits) if self.graphs is not None else None
        if bucket is not None:
            out = self.graphs.forward(bucket, slots, starts, tokens)
            self.num_forward_tokens += sum(num_new)
            return out.float()
        if self.decoder is not None:
            out = self.decoder.forward(make_layout(slots, starts, tokens, self.device, kernel=kernel), logits)
            self.num_forward_tokens += sum(num_new)
            return None if out is None else out.float()
        flex = kernel is None and (self.flex == "always" or (self.flex == "cheaper" and prefer_flex(
            [s + n for s, n in zip(starts, num_new)], self.device)))
        lay = make_layout(slots, starts, tokens, self.device, flex=flex, kernel=kernel)
        if flex:
            lay.flex = block_tables(lay.slots, lay.row_table[1], lay.row_table[2], self.cache.num_slots,
                                    lay.is_valid.shape[1], self.cache.max_len // BLOCK)
        # Positions to compute logits for: 0 (every token), else a 1D index tensor, the form every
        # transformers 5 release reads the same way (a boolean mask is only understood by recent ones).
        keep = 0 if logits == "all" else (lay.row_ends if logits == "last" else lay.row_ends[:1])   # "none": HF needs >= 1
        mask = None
        if not flex and kernel is None:
            mask, lay.rest_mask = attention_masks(lay, self.num_groups, self.dtype)
        out = self._model_forward(lay, mask, keep)
        self.num_forward_tokens += sum(num_new)
        return None if logits == "none" else out.float()                     # [kept, vocab]

    def _model_forward(self, lay, mask: torch.Tensor | None, keep) -> torch.Tensor:
        """The model's forward over the slot store for one layout: logits of the kept packed positions
        ([kept, vocab], the model's dtype)."""
        self.cache.layout = lay
        out = self.model(input_ids=lay.input_ids, position_ids=lay.flat_position_ids, attention_mask=mask,
                         use_cache=True, logits_to_keep=keep, slot_layout=lay,
                         **{self.cache_kwarg: self.cache})
        self.cache.layout = None
        return out.logits[0]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot `dst` gets slot `src`'s KV for positions [0, n): a shared prompt prefix, copied instead of
        computed (prefix.py). Counts no forwarded token."""
        self.cache.copy_positions(src, dst, n)

    @property
    def pads_rows(self) -> bool:
        """Whether a forward's attention may pad every row to the longest (torch's SDPA path): then
        callers batching long rows of unequal length (prefill) should group them."""
        return self.cpu_attention is None and self.flex != "always"

    def synchronize(self) -> None:
        """Wait for queued device work, so wall-clock timings are honest on asynchronous devices."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
