"""The adaptive policy's cost curves for an engine's models: measured once before the first step
(drafting/cost.py's CostModel.calibrate), kept in the kernel cache on CPU so that a later start of
the same models, kernels, slots and draft length reads them, and each step's seconds fed back to the
CostModel, which rescales them online.

Knows the engine's sizes, the runners' cached measurements and a launched step's counts; nothing of
which length a row drafts (drafting/adaptive.py) or of the round's stages.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .config import DraftingConfig, EngineConfig
from .drafting.cost import CostModel
from .launch import Launched
from .model.slots import measuring_context

if TYPE_CHECKING:
    from .model.runner import ModelRunner


def measured_curves(target: ModelRunner, draft: ModelRunner | None, cfg: EngineConfig, drafting: DraftingConfig,
                    repeats: int, fresh: bool) -> tuple[dict, bool]:
    """The cost curves of `target` and `draft` (CostModel.curves()), and whether they were read from the
    kernel cache; fresh: measured again, and kept for later starts."""
    max_draft = max(drafting.num_speculative_tokens, drafting.tree.max_tokens)   # a tree's tokens
    # On CPU a step of twice the slots' tokens is bound by its arithmetic: larger ones are extrapolated.
    # Where the runner timed plain steps up to its slots (max_num_seqs: auto), those are the curve up to
    # there, and past the slots it runs on along their last two: the cost of an added row, which bounds
    # that of an added token from above (a row reads its own KV, a token its row's), so that drafting
    # at a full batch is priced high, not low, until the run's steps say otherwise (StepFit).
    steps = target.plain_steps if cfg.max_num_seqs in target.plain_steps else {}
    cpu = target.device.type == "cpu"
    linear_past = (cfg.max_num_seqs if steps else 2 * cfg.max_num_seqs) if cpu else None

    def measure() -> dict:
        costs = CostModel()
        costs.calibrate(target, draft, cfg.max_num_seqs, max_draft, measuring_context(cfg.max_model_len),
                        repeats, linear_past=linear_past, known=None if fresh else steps)
        return costs.curves()
    fields = {"draft": draft.identity() if draft is not None else None, "slots": cfg.max_num_seqs,
              "max_draft": max_draft, "max_model_len": cfg.max_model_len, "repeats": repeats,
              "linear_past": linear_past, "plain_steps": sorted(steps)}
    return target.measured("cost-curves", fields, measure, fresh=fresh)


def observe_step(costs: CostModel, step: Launched, verify_s: float) -> None:
    """The step's draft and verify seconds, for the cost model's online rescaling."""
    guided = step.guided
    costs.observe(batch_size=len(step.batch), num_draft=sum(guided.num_drafted),
                  draft_s=step.draft_s - step.catch_up_s,
                  target_tokens=len(step.batch) + sum(guided.drafts.num_draft),
                  verify_s=verify_s, draft_steps=max(guided.num_drafted))
