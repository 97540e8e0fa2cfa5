"""The speculative decoding engine. See engine.py for the round and the glossary."""
from .config import DraftingConfig, EngineConfig, SuffixParams, TreeParams
from .core.request import RequestError, SamplingParams
from .drafting.base import DraftBatch, Drafter, NoDrafter
from .drafting.draft_model import DraftModelDrafter
from .drafting.hybrid import HybridDrafter
from .drafting.ngram import NgramDrafter
from .drafting.suffix import SuffixDrafter
from .engine import Completion, RoundRecord, SpecEngine, StepOutput
from .model.plan import Kernels
from .model.runner import ModelRunner

__all__ = ["Completion", "DraftBatch", "Drafter", "DraftingConfig", "DraftModelDrafter", "EngineConfig",
           "HybridDrafter", "Kernels", "ModelRunner", "NgramDrafter", "NoDrafter", "RequestError", "RoundRecord",
           "SamplingParams", "SpecEngine", "StepOutput", "SuffixDrafter", "SuffixParams", "TreeParams"]
