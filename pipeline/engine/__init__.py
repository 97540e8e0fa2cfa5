"""The speculative decoding engine. See engine.py for the round and the glossary.

Its names load on first use (PEP 562), so that the configs and request types (config.py,
core/request.py) import without torch: a driver reads them without loading the engine."""
from __future__ import annotations

import importlib

_WHERE = {
    "DraftingConfig": ".config", "EngineConfig": ".config", "SuffixParams": ".config", "TreeParams": ".config",
    "RequestError": ".core.request", "SamplingParams": ".core.request",
    "DraftBatch": ".drafting.base", "Drafter": ".drafting.base", "NoDrafter": ".drafting.base",
    "DraftModelDrafter": ".drafting.draft_model", "HybridDrafter": ".drafting.hybrid",
    "NgramDrafter": ".drafting.ngram", "SuffixDrafter": ".drafting.suffix",
    "Completion": ".records", "RoundRecord": ".records", "SpecEngine": ".engine", "StepOutput": ".records",
    "Kernels": ".model.plan", "ModelRunner": ".model.runner",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
