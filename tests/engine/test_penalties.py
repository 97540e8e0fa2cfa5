"""Repetition / presence / frequency penalties: speculative greedy output equals non-speculative
output, and both equal an independent step-by-step reference (uncached forwards, numpy penalties)."""
import numpy as np
import pytest
import torch

from conftest import DRAFTERS, make_engine, mixed_prompts_fixture, run_requests
from pipeline.engine import SamplingParams
from references import penalised

# Discouraging repetition (the usual use), and encouraging it (so n-gram lookup finds proposals).
PARAM_SETS = {
    "discourage": SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.4, presence_penalty=0.6,
                                 frequency_penalty=0.4),
    "encourage": SamplingParams(max_tokens=20, temperature=0, repetition_penalty=0.7, presence_penalty=-0.5,
                                frequency_penalty=0.3),
}


@torch.no_grad()
def penalised_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:
    out: list[int] = []
    for _ in range(p.max_tokens):
        logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].double().numpy()
        out.append(int(np.argmax(penalised(logits, prompt, out, p))))
    return out


prompts = mixed_prompts_fixture(12, seed=11)


@pytest.fixture(scope="module")
def references(target_model, prompts):
    return {name: [penalised_greedy(target_model, p, params) for p in prompts]
            for name, params in PARAM_SETS.items()}


@pytest.mark.parametrize("param_set", list(PARAM_SETS))
@pytest.mark.parametrize("kind", DRAFTERS)
def test_penalties_spec_equals_reference(target_model, draft_model, prompts, references, kind, param_set):
    engine = make_engine(target_model, kind, draft_model, max_num_seqs=4, max_model_len=128, g=4)
    done, rounds = run_requests(engine, prompts, PARAM_SETS[param_set], arrive_every=2)
    outputs = [done[str(i)].output_ids for i in range(len(prompts))]
    assert outputs == references[param_set]
    if kind != "none" and (param_set == "encourage" or kind not in ("ngram", "suffix")):   # no repeats to look up
        assert sum(r.accepted for r in rounds) > 0, "drafts must be accepted for the test to mean anything"


@pytest.mark.parametrize("param_set", list(PARAM_SETS))
def test_penalties_change_the_output(target_model, prompts, references, param_set):
    """Guard against a vacuous pass: the penalties must matter for these prompts."""
    engine = make_engine(target_model, "none", max_num_seqs=4, max_model_len=128)
    plain, _ = run_requests(engine, prompts, SamplingParams(max_tokens=20, temperature=0))
    changed = sum(plain[str(i)].output_ids != ref for i, ref in enumerate(references[param_set]))
    assert changed >= len(prompts) // 2
