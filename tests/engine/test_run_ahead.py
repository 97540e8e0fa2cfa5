"""Steps run ahead (engine.run_ahead): a step without drafts launches the next one before it is read back,
each row's next input taken from the device (pipeline/engine/ahead.py). The committed tokens must be those
of the engine that waits: the same greedy tokens, the same samples seed for seed (a row's uniforms are
drawn in the same order), the same stops, through admissions, EOS and stop strings that the host learns a
step late (the step run ahead for such a row is dropped), max_tokens (never run past), and the fallback
where no graph takes the step run ahead (the carried tokens are then read first).

On CPU the runner takes the bucketed graph path uncaptured (tests/engine/backends/test_cuda_graphs.py), so
these tests check everything but the overlap itself, which needs an asynchronous device.
"""
from __future__ import annotations

import collections

import pytest

from conftest import greedy_reference, make_engine, mixed_prompts, tiny_llama
from pipeline.engine import SamplingParams
from pipeline.engine.backends.cuda.graphs import UNCAPTURED
from pipeline.engine.config import EngineConfig
from pipeline.errors import ConfigError

GREEDY = SamplingParams(max_tokens=20)
MIXED = [
    GREEDY,
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9),
    SamplingParams(max_tokens=7),
    SamplingParams(max_tokens=30, temperature=0.7, top_k=30, min_p=0.02),
    SamplingParams(max_tokens=18, stop=("QX", "BB")),
    SamplingParams(max_tokens=16, temperature=1.0),
]


def _letters(ids: list[int]) -> str:
    return "".join(chr(65 + t % 26) for t in ids)


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def _run(target, run_ahead: str, params: list[SamplingParams], prompts, eos=(), kind="none", patch=None,
         arrive_every: int = 3, **engine_kw):
    """Four rows at once, the first four prompts queued and the rest arriving one per `arrive_every` steps.
    Returns ({id: (output ids, finish reason, text, rounds)}, the engine)."""
    engine = make_engine(target, kind, max_num_seqs=4, max_model_len=96, cpu_attention="off",
                         cuda_graphs=UNCAPTURED, run_ahead=run_ahead, eos=eos, decode=_letters, **engine_kw)
    if patch is not None:
        patch(engine)
    arrivals = [(str(i), p, params[i % len(params)], 100 + i) for i, p in enumerate(prompts)]
    for rid, p, sp, seed in arrivals[:4]:
        engine.add_request(rid, p, sp, seed=seed)
    arrivals, done, step = arrivals[4:], {}, 0
    while engine.has_unfinished() or arrivals:
        if arrivals and step % arrive_every == 0:
            rid, p, sp, seed = arrivals.pop(0)
            engine.add_request(rid, p, sp, seed=seed)
        for c in engine.step().finished:
            done[c.request_id] = (c.output_ids, c.finish_reason, c.text, c.num_rounds)
        step += 1
    return done, engine


def _common_tokens(done: dict, n: int) -> tuple[int, ...]:
    """n tokens the rows emit often past their first few (as EOS, they end rows at unforeseen steps)."""
    counts = collections.Counter(t for out, *_ in done.values() for t in out[3:])
    return tuple(t for t, _ in counts.most_common(n))


def test_same_tokens_as_the_engine_that_waits(target):
    prompts = mixed_prompts(12, target.config.vocab_size, seed=7)
    plain, _ = _run(target, "off", MIXED, prompts)
    eos = _common_tokens(plain, 2)
    waits, off = _run(target, "off", MIXED, prompts, eos=eos)
    ahead, on = _run(target, "on", MIXED, prompts, eos=eos)
    assert ahead == waits
    reasons = collections.Counter(reason for _, reason, *_ in ahead.values())
    assert reasons["eos"] >= 2 and reasons["length"] >= 2, reasons      # ends seen a step late, and foreseen
    assert off.num_steps_ahead == 0 and on.num_steps_ahead >= on.num_steps // 2
    # a row that ended by EOS or a stop cost at most one step's token run ahead for nothing
    unforeseen = reasons["eos"] + reasons["stop"]
    assert off.target.num_forward_tokens <= on.target.num_forward_tokens <= off.target.num_forward_tokens + unforeseen


def test_greedy_is_generate_and_length_ends_waste_nothing(target):
    prompts = mixed_prompts(6, target.config.vocab_size, seed=11)
    params = [SamplingParams(max_tokens=n) for n in (12, 5, 17, 9)]
    ahead, on = _run(target, "on", params, prompts, arrive_every=2)
    _, off = _run(target, "off", params, prompts, arrive_every=2)
    for i, p in enumerate(prompts):
        n = params[i % len(params)].max_tokens
        assert ahead[str(i)][0] == greedy_reference(target, p, n), i
    assert on.num_steps_ahead > 0
    assert on.target.num_forward_tokens == off.target.num_forward_tokens     # max_tokens is never run past


def test_rows_that_need_their_tokens_on_the_host_are_not_run_ahead(target):
    prompts = mixed_prompts(6, target.config.vocab_size, seed=3)
    penalised = [SamplingParams(max_tokens=12, temperature=0.8, repetition_penalty=1.2, presence_penalty=0.3)]
    ahead, on = _run(target, "on", penalised, prompts)
    waits, _ = _run(target, "off", penalised, prompts)
    assert ahead == waits and on.num_steps_ahead == 0
    mixed = [penalised[0]] + MIXED[1:]                # one penalised row among others: the rest may run ahead
    ahead, on = _run(target, "on", mixed, prompts)
    waits, _ = _run(target, "off", mixed, prompts)
    assert ahead == waits


def test_steps_with_drafts_are_not_run_ahead(target):
    prompts = mixed_prompts(6, target.config.vocab_size, seed=5)
    ahead, on = _run(target, "on", MIXED, prompts, kind="ngram")
    waits, _ = _run(target, "off", MIXED, prompts, kind="ngram")
    assert ahead == waits and on.num_steps_ahead == 0


def test_a_step_no_graph_takes_reads_the_carried_tokens_first(target):
    prompts = mixed_prompts(8, target.config.vocab_size, seed=9)
    refused = []

    def no_graph_when_carried(engine):
        launch = engine.target.launch_verify

        def refuse(slots, starts, tokens, step, carry=None):
            if carry is not None and len(refused) < 5:
                refused.append(len(slots))
                return None
            return launch(slots, starts, tokens, step, carry)
        engine.target.launch_verify = refuse

    ahead, on = _run(target, "on", MIXED, prompts, patch=no_graph_when_carried)
    waits, _ = _run(target, "off", MIXED, prompts)
    assert len(refused) == 5 and on.num_steps_ahead > 5
    assert ahead == waits


def test_the_switch():
    with pytest.raises(ConfigError, match="engine.run_ahead"):
        EngineConfig(run_ahead="sometimes")
    assert EngineConfig(run_ahead=False).run_ahead == "off"        # YAML's bare off
    model = tiny_llama()
    with pytest.raises(ValueError, match="engine.run_ahead=on"):
        make_engine(model, cpu_attention="off", cuda_graphs="off", run_ahead="on")
    assert not make_engine(model, cpu_attention="off", cuda_graphs=UNCAPTURED).run_ahead   # auto: captured only
    assert make_engine(model, cpu_attention="off", cuda_graphs=UNCAPTURED, run_ahead="on").run_ahead
    with pytest.raises(ValueError, match="engine.run_ahead=on"):     # verification after the graph
        make_engine(model, cpu_attention="off", cuda_graphs=UNCAPTURED, run_ahead="on",
                    target_switches=dict(graph_verify=False))


def test_the_next_step_is_launched_before_this_one_is_read(target, monkeypatch):
    """The order the host keeps: step N + 1's launch comes before step N's readback, so a device that
    runs asynchronously never waits for the host's commit between them."""
    from pipeline.engine.core import verify_step
    events, kept = [], []              # kept: every readback stays alive, so that no id is reused
    result = verify_step.Readback.result

    def read(self):
        if self._result is None:
            events.append(("read", id(self)))
        return result(self)
    monkeypatch.setattr(verify_step.Readback, "result", read)

    def log_launches(engine):
        launch = engine.target.launch_verify

        def logged(*args, **kwargs):
            readback = launch(*args, **kwargs)
            kept.append(readback)
            events.append(("launch", id(readback)))
            return readback
        engine.target.launch_verify = logged

    prompts = mixed_prompts(4, target.config.vocab_size, seed=2)
    _, on = _run(target, "on", [SamplingParams(max_tokens=10)], prompts, patch=log_launches)
    launches = [rid for kind, rid in events if kind == "launch"]
    reads = {rid: i for i, (kind, rid) in enumerate(events) if kind == "read"}
    launched_at = {rid: i for i, (kind, rid) in enumerate(events) if kind == "launch"}
    ahead = sum(1 for before, after in zip(launches, launches[1:]) if launched_at[after] < reads[before])
    assert ahead == on.num_steps_ahead and ahead >= 5
