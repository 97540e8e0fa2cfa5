"""The speculative decoding engine. See engine.py for the round and the glossary."""
from .drafters import DraftBatch, Drafter, DraftModelDrafter, HybridDrafter, NgramDrafter, NoDrafter
from .engine import Completion, EngineConfig, RoundRecord, SpecEngine, StepOutput
from .request import RequestError, SamplingParams
from .runner import ModelRunner
from .suffix import SuffixDrafter, SuffixParams

__all__ = ["Completion", "DraftBatch", "Drafter", "DraftModelDrafter", "EngineConfig", "HybridDrafter",
           "ModelRunner", "NgramDrafter", "NoDrafter", "RequestError", "RoundRecord", "SamplingParams", "SpecEngine",
           "StepOutput", "SuffixDrafter", "SuffixParams"]
