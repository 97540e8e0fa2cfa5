"""Stops inside a round: EOS, stop token ids, stop strings (spanning tokens) and max_tokens hit in
the middle of a round commit nothing past the stop. The draft is the target itself, so every round
proposes and accepts 4 tokens and stops genuinely fall mid-round."""
import pytest

from conftest import greedy_reference, make_engine
from pipeline.engine import SamplingParams

PROMPT = [5, 17, 33, 2, 9, 41]
G = 4


def decode(ids: list[int]) -> str:
    """A toy detokenizer: token t is two letters, so a 3-letter stop string spans two tokens."""
    return "".join(chr(97 + t % 26) + chr(97 + (t // 26) % 26) for t in ids)


@pytest.fixture(scope="module")
def ref(target_model):
    return greedy_reference(target_model, PROMPT, 24)


def run_one(target_model, params, eos=()):
    engine = make_engine(target_model, "draft-greedy", target_model, max_num_seqs=2, g=G, eos=eos, decode=decode)
    engine.add_request("a", PROMPT, params)
    rounds = []
    done = []
    while engine.has_unfinished():
        out = engine.step()
        rounds.extend(out.rounds)
        done.extend(out.finished)
    return done[0], rounds


def first_index_not_before(ref, start):
    """A position >= start whose token does not occur earlier in ref (so it stops exactly there)."""
    return next(i for i in range(start, len(ref)) if ref[i] not in ref[:i])


def test_eos_mid_round(target_model, ref):
    stop_at = first_index_not_before(ref, 6)   # position 6: inside the 2nd round (tokens 5..9)
    out, rounds = run_one(target_model, SamplingParams(max_tokens=24, temperature=0), eos=[ref[stop_at]])
    assert out.output_ids == ref[:stop_at + 1] and out.finish_reason == "eos"
    assert rounds[-1].emitted < rounds[-1].accepted + 1, "the stop must cut a round short"
    assert sum(r.emitted for r in rounds) == len(out.output_ids)


def test_stop_token_id_mid_round(target_model, ref):
    stop_at = first_index_not_before(ref, 7)
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(ref[stop_at],))
    out, _ = run_one(target_model, params)
    assert out.output_ids == ref[:stop_at + 1] and out.finish_reason == "stop"


def test_stop_string_spanning_tokens(target_model, ref):
    full = decode(ref)
    start = 2 * first_index_not_before(ref, 6) + 1         # second letter of one token + first of next
    stop = full[start:start + 3]
    assert full.find(stop) == start, "pick a stop string that occurs first here"
    out, _ = run_one(target_model, SamplingParams(max_tokens=24, temperature=0, stop=(stop,)))
    assert out.finish_reason == "stop"
    assert out.text == full[:start]
    assert out.output_ids == ref[:(start + 3 + 1) // 2]     # up to the token completing the stop


def test_ignore_eos(target_model, ref):
    out, _ = run_one(target_model, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), eos=[ref[3]])
    assert out.output_ids == ref[:12] and out.finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [1, 3, 7, 10])
def test_max_tokens(target_model, ref, max_tokens):
    out, rounds = run_one(target_model, SamplingParams(max_tokens=max_tokens, temperature=0))
    assert out.output_ids == ref[:max_tokens] and out.finish_reason == "length"
    assert all(r.draft_len <= max_tokens - 1 for r in rounds), "never draft past max_tokens"


def test_context_limit(target_model, ref):
    engine = make_engine(target_model, "draft-greedy", target_model, max_num_seqs=2, max_model_len=len(PROMPT) + 7, g=G)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=100, temperature=0))
    (out,) = engine.run()
    assert out.output_ids == ref[:7] and out.finish_reason == "context"
