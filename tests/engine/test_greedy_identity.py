"""Greedy identity: the engine's output equals target-only greedy decoding, for every drafter, at
batch sizes 1, 4 and 16, with requests arriving while others run, on each forward path: our CPU
kernels in one loop (cpu_decoder.py), the same kernels under the model's own modules, torch's padded
SDPA, and the compiled FlexAttention. Where tokens differ, the first
difference must sit on a numerical near-tie of the target's top-2 logits, or the test fails."""
import pytest

from conftest import (DRAFTERS, greedy_references_fixture, make_engine, mixed_prompts_fixture, near_tie_mismatches,
                      run_requests, tiers)
from pipeline.engine import SamplingParams

NUM_PROMPTS, MAX_NEW = 50, 24
prompts = mixed_prompts_fixture(NUM_PROMPTS, seed=7)
references = greedy_references_fixture(MAX_NEW)


GRID = [(attention, kind, batch_size) for attention in ("cpu", "modules", "sdpa", "flex") for kind in DRAFTERS
        for batch_size in (1, 4, 16)]


@pytest.mark.parametrize("attention,kind,batch_size", tiers(GRID, {("cpu", "hybrid", 4)}))
def test_greedy_identity(target_model, draft_model, prompts, references, kind, batch_size, attention):
    engine = make_engine(target_model, kind, draft_model, max_num_seqs=batch_size, max_model_len=128, g=4,
                         compile="on" if attention == "flex" else "off",
                         cpu_attention="on" if attention in ("cpu", "modules") else "off",
                         cpu_decoder="on" if attention == "cpu" else "off")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    done, rounds = run_requests(engine, prompts, params, arrive_every=3)
    assert sorted(done, key=int) == [str(i) for i in range(NUM_PROMPTS)]
    assert all(done[str(i)].finish_reason == "length" for i in range(NUM_PROMPTS))
    outputs = [done[str(i)].output_ids for i in range(NUM_PROMPTS)]
    mismatches = near_tie_mismatches(target_model, prompts, outputs, references)
    assert mismatches <= 2, f"{mismatches} near-tie mismatches out of {NUM_PROMPTS}"
    if kind != "none":     # the drafts must actually have been exercised, or identity is trivial
        assert sum(r.accepted for r in rounds) > 0
        assert sum(r.draft_len - r.accepted for r in rounds) > 0
    assert max(r.batch_size for r in rounds) == batch_size
