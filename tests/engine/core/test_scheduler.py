"""Continuous batching bookkeeping, in plain Python (no torch, no model)."""
from pipeline.engine.core.request import SamplingParams, Sequence, Status
from pipeline.engine.core.scheduler import Scheduler


def seq(i, prompt_len=5):
    return Sequence(str(i), list(range(prompt_len)), SamplingParams(), 0)


def test_admission_takes_lowest_free_slot_at_once():
    sched = Scheduler(max_num_seqs=3, max_prefill_tokens=100)
    seqs = [seq(i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    assert [s.slot for s in sched.admit()] == [0, 1, 2]
    for s in seqs[:3]:
        sched.promote(s)
    assert sched.admit() == []                       # full
    seqs[1].finish("eos")
    sched.release(seqs[1])
    admitted = sched.admit()                         # the freed slot is reused in the same step
    assert [(s.request_id, s.slot) for s in admitted] == [("3", 1)]
    assert [s.request_id for s in sched.running] == ["0", "2"]
    sched.promote(seqs[3])
    assert [s.slot for s in sched.running] == [0, 1, 2]   # kept in slot order
    assert sched.has_unfinished() and len(sched.waiting) == 1


def test_prefill_budget_chunks_long_prompts():
    sched = Scheduler(max_num_seqs=4, max_prefill_tokens=10)
    long, short = seq("long", 25), seq("short", 4)
    sched.add(long)
    sched.add(short)
    sched.admit()
    computed = {"long": 0, "short": 0}
    need = lambda s: len(s.prompt_ids) - 1 - computed[s.request_id]
    plan = []
    while any(need(s) for s in (long, short)):
        chunks = sched.prefill_chunks(need)
        assert sum(n for _, n in chunks) <= 10
        for s, n in chunks:
            computed[s.request_id] += n
        plan.append([(s.request_id, n) for s, n in chunks])
    assert plan == [[("long", 10)], [("long", 10)], [("long", 4), ("short", 3)]]


def test_commit_stops_at_first_stop_condition():
    s = Sequence("a", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=(7,)), 0)
    assert s.commit([4, 7, 9], eos_ids=[], max_model_len=100) == 2
    assert s.output_ids == [4, 7] and s.finish_reason == "stop" and s.status is Status.FINISHED
    s = Sequence("b", [1, 2], SamplingParams(max_tokens=2), 0)
    assert s.commit([4, 5, 6], eos_ids=[5], max_model_len=100) == 2
    assert s.finish_reason == "eos"
    s = Sequence("c", [1, 2], SamplingParams(max_tokens=50), 0)
    assert s.commit([4, 5, 6], eos_ids=[], max_model_len=4) == 2
    assert s.finish_reason == "context" and s.num_tokens == 4
