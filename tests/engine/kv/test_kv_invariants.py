"""KV invariants after every round, and proof that accepted tokens are never recomputed."""
import pytest
import torch

from conftest import dynamic_cache_keys, make_engine, mixed_prompts
from pipeline.engine import SamplingParams


@pytest.mark.parametrize("kind", ["none", "draft-greedy", "draft-prob", "ngram", "hybrid"])
@pytest.mark.parametrize("attention", ["cpu", "modules", "sdpa", "flex"])
def test_lengths_and_contents_after_every_round(target_model, draft_model, kind, attention):
    engine = make_engine(target_model, kind, draft_model, max_num_seqs=4, max_model_len=128, g=3,
                         max_prefill_tokens=16, compile="on" if attention == "flex" else "off",
                         cpu_attention="on" if attention in ("cpu", "modules") else "off",
                         cpu_decoder="on" if attention == "cpu" else "off")
    prompts = mixed_prompts(10, target_model.config.vocab_size, seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=0.8), seed=i)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        for seq in engine.scheduler.running:
            # the target lags the committed tokens by exactly one (the next round's first input)
            assert seq.num_computed == seq.num_tokens - 1
            if kind in ("draft-greedy", "draft-prob"):
                # the draft keeps KV for committed tokens only, at most 2 behind (after a bonus token)
                assert seq.num_tokens - 3 <= engine.drafter.num_computed(seq) <= seq.num_tokens - 1
            elif kind == "hybrid":
                assert engine.drafter.num_computed(seq) <= seq.num_tokens - 1
            else:                  # no draft model: no draft KV at all
                assert engine.drafter.draft_runner is None
            if steps % 3 == 0:    # contents: the slot holds exactly the committed history's KV
                n = seq.num_computed
                got = engine.target.cache.keys[0][seq.slot, :, :n]
                torch.testing.assert_close(got, dynamic_cache_keys(target_model, seq.all_ids()[:n]),
                                           atol=2e-4, rtol=1e-4)
        for seq in engine.scheduler.prefilling:   # chunked prefill never runs past the prompt
            assert seq.num_computed <= len(seq.prompt_ids) - 1
    assert steps > 20


def test_no_recomputation_of_accepted_tokens(target_model, draft_model):
    engine = make_engine(target_model, "draft-greedy", draft_model, max_num_seqs=4, max_model_len=128, g=4)
    prompts = mixed_prompts(12, target_model.config.vocab_size, seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=25, temperature=0))
    rounds = []
    while engine.has_unfinished():
        rounds.extend(engine.step().rounds)
    prefill = sum(len(p) - 1 for p in prompts)
    verified = sum(r.draft_len + 1 for r in rounds)
    # every target token forwarded was a prompt token once, or a round input once
    assert engine.target.num_forward_tokens == prefill + verified
    # round inputs are: committed tokens (each exactly once) + rejected drafts (discarded)
    rejected = sum(r.draft_len - r.accepted for r in rounds)
    committed = sum(r.emitted for r in rounds)
    assert verified == committed + rejected
    assert committed == 25 * len(prompts)
    assert sum(r.accepted for r in rounds) > len(prompts), "drafts must be accepted for the test to mean anything"
