"""Bad input gets a clear error naming the field and the allowed range, and never disturbs the
other sequences in the batch."""
import copy
import pytest

from conftest import make_engine, mixed_prompts, run_requests, tiny_llama
from pipeline.engine import DraftingConfig, DraftModelDrafter, EngineConfig, RequestError, SamplingParams, SpecEngine
from pipeline.engine.model.runner import build_runner


@pytest.mark.parametrize("kwargs, field, expected", [
    ({"temperature": -0.5}, "temperature", ">= 0"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"top_k": -1}, "top_k", ">= 0"),
    ({"min_p": 2.0}, "min_p", "[0, 1]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
    ({"presence_penalty": 3.0}, "presence_penalty", "[-2, 2]"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"stop": ("",)}, "stop", "non-empty"),
])
def test_bad_sampling_params(kwargs, field, expected):
    with pytest.raises(RequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert field in str(err.value) and expected in str(err.value)


def test_bad_prompts(target_model):
    engine = make_engine(target_model, "none", max_num_seqs=2, max_model_len=32)
    cases = [([], "prompt", "empty"), (list(range(40)), "prompt", "at most 31"),
             ([1, 2, 10_000], "prompt", "outside [0, 512)")]
    for prompt, field, expected in cases:
        with pytest.raises(RequestError) as err:
            engine.add_request("x", prompt)
        assert err.value.field == field and expected in str(err.value)
    engine.add_request("dup", [1, 2])
    with pytest.raises(RequestError, match="request_id: duplicate"):
        engine.add_request("dup", [3])


def test_mismatched_draft_vocabulary(target_model):
    other = tiny_llama(vocab=300)
    drafter = DraftModelDrafter(build_runner(other, 2, 64, packed_linear=False))
    with pytest.raises(ValueError, match=r"draft vocabulary \(300\) does not match the target's \(512\)"):
        SpecEngine(build_runner(copy.deepcopy(target_model), 2, 64, packed_linear=False), drafter, EngineConfig(max_num_seqs=2, max_model_len=64))


def test_bad_engine_config():
    with pytest.raises(ValueError, match="engine.max_num_seqs: expected an integer >= 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="drafting.num_speculative_tokens"):
        DraftingConfig(num_speculative_tokens=-1)


def test_bad_request_does_not_disturb_batch(target_model, draft_model):
    prompts = mixed_prompts(8, target_model.config.vocab_size, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.7)
    clean, _ = run_requests(make_engine(target_model, "draft-prob", draft_model, max_num_seqs=4), prompts, params)
    engine = make_engine(target_model, "draft-prob", draft_model, max_num_seqs=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done, errors, step = {}, [], 0
    while engine.has_unfinished():
        if step in (1, 3, 5):        # bad requests arrive mid-run
            for bad in ([], list(range(10_000))):
                try:
                    engine.add_request(f"bad{step}-{len(bad)}", bad, params)
                except RequestError as e:
                    errors.append(e.field)
        done.update({c.request_id: c for c in engine.step().finished})
        step += 1
    assert errors == ["prompt"] * 6
    assert {k: v.output_ids for k, v in done.items()} == {k: v.output_ids for k, v in clean.items()}
