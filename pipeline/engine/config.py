"""The engine's configuration: one dataclass per concept, validated once, with the one set of
backend modes. The job's YAML sections are these classes.

It knows nothing about files, models or Ray.
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("auto", "on", "off")   # a backend switch: auto (where it can run) | on (raise where not) | off


@dataclass
class EngineConfig:
    max_num_seqs: int = 16           # running sequences at most (= KV slots per model)
    max_model_len: int = 2048        # prompt + output tokens per sequence (KV positions per slot)
    num_speculative_tokens: int = 4  # draft length g (the maximum, when adaptive)
    adaptive: bool = False           # per-sequence g from its acceptance and measured costs; may be 0
    max_prefill_tokens: int = 512    # prompt tokens prefilled per step, all new sequences together
    packed_linear: bool = True       # CPU: regroup linear weights once for a faster kernel (cpu_linear's, else
                                     # oneDNN's); false: torch's F.linear (ignored elsewhere)
    compile: str = "auto"            # compiled FlexAttention over the slot store (flex.py): auto (where
                                     # inductor can compile, on steps where it is the cheaper kernel) |
                                     # on (every step) | off (eager padded SDPA)
    cpu_attention: str = "auto"      # attention on CPU by our C kernel (cpu_attention.py), each row its own keys:
                                     # auto (where it builds, fp32/bf16) | on (raise where not) | off (torch)
    cpu_linear: str = "auto"         # with packed_linear, on CPU: our C panel kernel (cpu_linear.py), fp32/bf16:
                                     # auto (where it builds) | on (raise where not) | off (oneDNN's)
    cpu_fused: str = "auto"          # on CPU: RMSNorm and silu(gate) * up as one pass each (cpu_fused.py):
                                     # auto (where it builds) | on (raise where not) | off (the model's modules)
    cpu_decoder: str = "auto"        # on CPU: the forward as one loop over the kernels above (cpu_decoder.py):
                                     # auto (where they are all in use) | on (raise where not) | off
    prefix_reuse: bool = True        # a new prompt copies the target KV of its longest prefix some slot holds
                                     # (a running or just-finished sequence's prompt) instead of computing it
    cuda_graphs: str = "auto"        # steps replayed as captured CUDA graphs (cuda_graphs.py): auto (on CUDA) |
                                     # on (raise elsewhere) | off (every step launched from Python)

    def __post_init__(self):
        for name, low in (("max_num_seqs", 1), ("max_model_len", 2), ("num_speculative_tokens", 0),
                          ("max_prefill_tokens", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"engine.{name}: expected an integer >= {low}, got {value!r}")
        if self.compile not in MODES:
            raise ValueError(f"engine.compile: expected one of {MODES}, got {self.compile!r}")
        if self.cpu_attention not in MODES:
            raise ValueError(f"engine.cpu_attention: expected one of {MODES}, "
                             f"got {self.cpu_attention!r}")
        if self.cpu_linear not in MODES:
            raise ValueError(f"engine.cpu_linear: expected one of {MODES}, got {self.cpu_linear!r}")
        if self.cpu_fused not in MODES:
            raise ValueError(f"engine.cpu_fused: expected one of {MODES}, got {self.cpu_fused!r}")
        if self.cpu_decoder not in MODES:
            raise ValueError(f"engine.cpu_decoder: expected one of {MODES}, got {self.cpu_decoder!r}")
        if self.cuda_graphs not in MODES:
            raise ValueError(f"engine.cuda_graphs: expected one of {MODES}, got {self.cuda_graphs!r}")
        if not isinstance(self.prefix_reuse, bool):
            raise ValueError(f"engine.prefix_reuse: expected true or false, got {self.prefix_reuse!r}")
        if self.cpu_linear == "on" and not self.packed_linear:
            raise ValueError("engine.cpu_linear=on needs engine.packed_linear=true (false keeps torch's linears)")
