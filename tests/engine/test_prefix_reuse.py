"""Prompt-prefix reuse (pipeline/engine/core/prefix.py): a new prompt copies the target KV of the longest
prefix a slot holds instead of computing it. The index on its own (torch-free), then the engine on
prompts built to share prefixes (a common "system prompt", repeated prompts, a prompt that extends
another), checked against Hugging Face greedy decoding and against the engine with reuse off."""
import copy
import random

import pytest
import torch

from conftest import greedy_references_fixture, make_engine, near_tie_mismatches, run_requests
from pipeline.engine import DraftModelDrafter, SamplingParams
from pipeline.engine.core.prefix import PrefixIndex, Reuse, _bytes, common_prefix
from pipeline.engine.core.request import Sequence
from pipeline.engine.model.runner import build_runner

MAX_NEW = 16


def test_common_prefix_matches_a_plain_loop():
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
        limit = rng.randrange(0, 40)
        want = 0
        while want < min(len(a), len(b), limit) and a[want] == b[want]:
            want += 1
        assert common_prefix(_bytes(a), _bytes(b), limit) == want


class _Seq:
    """What the index reads of a Sequence (hashable by identity, like it)."""

    def __init__(self, slot, prompt, computed=0):
        self.slot, self.prompt_ids, self.num_computed = slot, prompt, computed


_seq = _Seq


def _admit(index, seq):
    index.admit(seq)
    return index.plan(seq)


def test_index_picks_the_longest_valid_prefix_and_forgets_a_retaken_slot():
    index = PrefixIndex(min_tokens=3)
    base = list(range(100, 120))
    a = _seq(0, base + [1, 2, 3])
    assert _admit(index, a) == Reuse()                         # nothing held yet
    b = _seq(1, base + [7])
    assert _admit(index, b) is None                          # a is computing 20 shared positions: wait
    a.num_computed = 10
    assert index.plan(b) is None                             # still 10 short
    a.num_computed = len(a.prompt_ids) - 1
    assert index.plan(b) == Reuse(0, 20, a) and index.num_waits == 2
    b.num_computed = len(b.prompt_ids) - 1
    c = _seq(2, base + [1, 2, 3, 4])
    assert _admit(index, c) == Reuse(0, 22, a)                # the longer match: a's 22 computed positions
    c.num_computed = len(c.prompt_ids) - 1
    same = _seq(3, list(a.prompt_ids))
    assert _admit(index, same) == Reuse(0, len(a.prompt_ids) - 1, a)   # the last prompt token is the round's input
    index.release(a)                                         # a finished: slot 0 still holds its prompt
    a2 = _seq(0, base + [1, 2, 9])                           # the freed slot itself is the donor: no copy
    assert _admit(index, a2) == Reuse(0, 22, None)         # no live holder
    a2.num_computed = 20                                     # (a2 prefilled over slot 0 from here on)
    short = _seq(4, base[:2] + [5, 5])
    assert _admit(index, short) == Reuse()                    # 2 shared tokens < min_tokens
    index.release(a2)
    d = _seq(0, [9] * 30)                                    # slot 0 retaken by an unrelated prompt
    assert _admit(index, d) == Reuse()
    d.num_computed = 29
    index.release(a2)                                        # a stale release does not touch d's entry
    e = _seq(5, base + [1, 2, 3])
    assert _admit(index, e) == Reuse(2, 22, c)                 # slot 0's old prefix is gone; c still has it
    assert index.num_reused == 20 + 22 + 22 + 22 + 22


def test_waits_only_on_earlier_sequences():
    """Two sequences admitted together share a prefix: the later one waits for the earlier, never
    the other way round (no cycle), and a finished donor's prefix is taken as it was."""
    index = PrefixIndex(min_tokens=3)
    p = list(range(50))
    first, second = _seq(0, p + [1]), _seq(1, p + [2])
    index.admit(first)
    index.admit(second)
    assert index.plan(first) == Reuse()                        # second is later: first does not wait
    assert index.plan(second) is None
    first.num_computed = 25
    index.release(first)                                     # finished early (say, cancelled) at 25
    assert index.plan(second) == Reuse(0, 25, None)


def shared_prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    """24 prompts in six families of four: each family has its own 30-token prefix (so a slot's old
    content is another family's, and a wrong copy shows), then own tails, an exact repeat, an
    extension of the repeat, and a sibling with another tail."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(6):
        system = [rng.randrange(vocab) for _ in range(30)]
        first = system + [rng.randrange(vocab) for _ in range(rng.choice([1, 5, 12]))]
        prompts += [first, list(first), first + [rng.randrange(vocab) for _ in range(7)],
                    system + [rng.randrange(vocab) for _ in range(rng.choice([3, 9]))]]
    return prompts


@pytest.fixture(scope="module")
def prompts(target_model):
    return shared_prompts(target_model.config.vocab_size)


references = greedy_references_fixture(MAX_NEW)


def _run(target_model, draft_model, prompts, kind, batch_size, attention, reuse, params):
    engine = make_engine(target_model, kind, draft_model, max_num_seqs=batch_size, max_model_len=128, g=3,
                         compile="on" if attention == "flex" else "off",
                         cpu_attention="on" if attention == "cpu" else "off", prefix_reuse=reuse)
    done, rounds = run_requests(engine, prompts, params, arrive_every=2, seeds=list(range(len(prompts))))
    return engine, done


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
@pytest.mark.parametrize("attention", ["cpu", "sdpa"])
def test_reuse_keeps_greedy_output_and_skips_the_shared_positions(target_model, draft_model, prompts, references,
                                                                   kind, batch_size, attention):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    on, done_on = _run(target_model, draft_model, prompts, kind, batch_size, attention, True, params)
    off, done_off = _run(target_model, draft_model, prompts, kind, batch_size, attention, False, params)
    reused = on.prefixes.num_reused
    assert off.prefixes is None and reused > 0
    if batch_size == 4:      # families arrive together: the repeats and extensions find their donor
        assert reused >= 12 * 30, reused
    # every reused position is one the target did not forward, and nothing else changed
    assert off.target.num_forward_tokens - on.target.num_forward_tokens == reused
    # each completion says how many of its prompt positions were copied (the job summary's sum)
    assert sum(c.prompt_tokens_reused for c in done_on.values()) == reused
    assert all(c.prompt_tokens_reused < c.prompt_len for c in done_on.values())
    assert not any(c.prompt_tokens_reused for c in done_off.values())
    outputs = [done_on[str(i)].output_ids for i in range(len(prompts))]
    for i, out in enumerate(outputs):
        assert out == done_off[str(i)].output_ids, f"prompt {i}: reuse changed the output"
    near_tie_mismatches(target_model, prompts, outputs, references)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["none", "ngram"])
def test_reuse_keeps_sampled_output(target_model, draft_model, prompts, kind):
    """Copied KV is bitwise the computed KV on our CPU kernels (per-row linears and attention), so
    the same seeds sample the same tokens with reuse on and off."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=1.0)
    on, done_on = _run(target_model, draft_model, prompts, kind, 4, "cpu", True, params)
    _, done_off = _run(target_model, draft_model, prompts, kind, 4, "cpu", False, params)
    assert on.prefixes.num_reused > 0
    assert {k: c.output_ids for k, c in done_on.items()} == {k: c.output_ids for k, c in done_off.items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["draft", "hybrid"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_the_draft_model_reuses_the_prefix_too(target_model, draft_model, prompts, kind, batch_size):
    """Where the target copies a prompt prefix, the draft model copies its own KV of it (from the
    donor slot's holder, or in place from the slot's last holder): the draft forwards fewer tokens,
    and every sequence's rounds (draft lengths, accepted counts) are exactly those with reuse off,
    which a wrong copy (another prompt's KV) would change."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    runs = {}
    for reuse in (True, False):
        engine = make_engine(target_model, kind, draft_model, max_num_seqs=batch_size, max_model_len=128, g=3,
                             prefix_reuse=reuse)
        done, rounds = run_requests(engine, prompts, params, arrive_every=2, seeds=list(range(len(prompts))))
        per_seq = {}
        for r in rounds:
            per_seq.setdefault(r.request_id, []).append((r.draft_len, r.accepted))
        runs[reuse] = (engine.drafter.draft_runner.num_forward_tokens, done, per_seq)
    (fwd_on, done_on, rounds_on), (fwd_off, done_off, rounds_off) = runs[True], runs[False]
    target_reused = sum(c.prompt_tokens_reused for c in done_on.values())
    saved = fwd_off - fwd_on
    assert 0 < saved <= target_reused, (saved, target_reused)
    if batch_size == 4:
        assert saved >= 12 * 30, saved
    assert {k: c.output_ids for k, c in done_on.items()} == {k: c.output_ids for k, c in done_off.items()}
    assert rounds_on == rounds_off


def test_draft_copies_only_what_its_store_holds_for_the_donor(draft_model):
    """DraftModelDrafter.reuse_prefix caps the copy at the prompt positions of draft KV the donor
    slot holds: its live holder's (lazy drafting may have computed few), or in place what the last
    holder left; the copied positions are the donor's, bitwise."""
    drafter = DraftModelDrafter(build_runner(copy.deepcopy(draft_model), 3, 64, packed_linear=False))
    params = SamplingParams(max_tokens=4, temperature=0)
    prompt = list(range(3, 33))
    seqs = [Sequence(f"s{i}", list(prompt), params, 0, slot=i) for i in range(3)]
    for seq in seqs[:2]:
        drafter.reuse_prefix(seq, Reuse())
    drafter.prefill([(seqs[0], 12), (seqs[1], 20)])               # the live holders' draft KV: 12 and 20
    drafter.reuse_prefix(seqs[2], Reuse(0, 25, seqs[0]))         # the target copies 25; the draft holds 12
    assert drafter.num_computed(seqs[2]) == 12
    keys = drafter.runner.cache.keys[0]
    assert torch.equal(keys[2, :, :12], keys[0, :, :12]) and keys[2, :, :12].any() and not keys[2, :, 12:].any()
    drafter.release(seqs[1])                                     # leaves 20 positions in slot 1
    again = Sequence("s3", list(prompt), params, 0, slot=1)
    drafter.reuse_prefix(again, Reuse(1, 25, None))              # in place: what s1 left
    assert drafter.num_computed(again) == 20
    drafter.release(again)                                       # left nothing new of its own: 20
    other = Sequence("s4", list(prompt), params, 0, slot=1)
    drafter.reuse_prefix(other, Reuse())                         # nothing reused: the slot's old KV is void
    drafter.release(other)
    last = Sequence("s5", list(prompt), params, 0, slot=1)
    drafter.reuse_prefix(last, Reuse(1, 25, None))
    assert drafter.num_computed(last) == 0


def test_reset_prefix_cache_forgets_held_prefixes(target_model):
    """After reset_prefix_cache a prompt that a finished sequence's slot still holds is computed again
    (forwarded tokens say so); resetting while a request runs is refused."""
    engine = make_engine(target_model, "none", max_num_seqs=2, max_model_len=128)
    prompt = list(range(10, 40))
    params = SamplingParams(max_tokens=4, temperature=0)
    run_requests(engine, [prompt], params, ids=["a"])
    before = engine.target.num_forward_tokens
    done, _ = run_requests(engine, [prompt], params, ids=["b"])    # reuses "a"'s prompt KV
    reused_run = engine.target.num_forward_tokens - before
    assert engine.prefixes.num_reused == done["b"].prompt_tokens_reused == len(prompt) - 1
    engine.reset_prefix_cache()
    before = engine.target.num_forward_tokens
    run_requests(engine, [prompt], params, ids=["c"])
    assert engine.target.num_forward_tokens - before == reused_run + len(prompt) - 1
    assert engine.prefixes.num_reused == 0
    engine.add_request("d", prompt, params)
    with pytest.raises(RuntimeError, match="still running"):
        engine.reset_prefix_cache()
