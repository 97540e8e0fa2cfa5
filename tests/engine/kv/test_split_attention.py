"""The padded path's split (kv_cache.SplitRows): a step where few rows carry drafts attends every
row's first token over the batch's keys and the drafting rows' other tokens over their own keys.
Checked against each row forwarded alone (no padding at all), with non-contiguous slots. fp32 sums
in another order differ by ~1e-4 here (the unsplit padded path differs from single rows as much);
a wrong mask, gather or scatter differs by the logits' own scale (~1)."""
import copy

import pytest
import torch

from conftest import tiny_llama
from pipeline.engine.kv.layout import make_layout
from pipeline.engine.model.runner import build_runner


def test_layout_splits_only_when_few_rows_have_more_than_one_token():
    one = [[7]]
    assert make_layout([0, 1, 2, 3], [5] * 4, one * 3 + [[7, 8, 9]], "cpu").split is not None
    assert make_layout([0, 1, 2, 3], [5] * 4, one * 2 + [[7, 8]] * 2, "cpu").split is not None
    assert make_layout([0, 1, 2, 3], [5] * 4, one + [[7, 8]] * 3, "cpu").split is None    # most rows draft
    assert make_layout([0, 1, 2, 3], [5] * 4, one * 4, "cpu").split is None               # nothing to split
    assert make_layout([0, 1, 2, 3], [5] * 4, one * 3 + [[7, 8]], "cpu", flex=True).split is None  # flex
    lay = make_layout([3, 0, 2], [10, 20, 30], [[1], [2, 3, 4], [5]], "cpu")
    s = lay.split
    assert s.row_starts.tolist() == [0, 1, 4] and s.multi.tolist() == [1]
    assert s.rest_tokens.tolist() == [2, 3] and s.rest_row.tolist() == [0, 0] and s.rest_q.tolist() == [0, 1]
    assert s.kv_len == 23 and lay.kv_len == 31


@pytest.mark.parametrize("slots", [[0, 1, 2, 3, 4, 5, 6], [6, 2, 0, 5, 1, 4, 3]])
def test_split_step_logits_equal_each_row_alone(slots):
    model = tiny_llama()
    together, alone = (build_runner(copy.deepcopy(model), 8, 256, packed_linear=False, compile="off", cpu_attention="off")
                       for _ in range(2))
    gen = torch.Generator().manual_seed(5)
    history = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (40, 90, 25, 60, 33, 70, 50)]
    new = [1, 1, 4, 1, 3, 1, 1]                        # two rows draft, five run g = 0
    prompts = [h[:-n] for h, n in zip(history, new)]
    starts = [len(p) for p in prompts]
    steps = [h[-n:] for h, n in zip(history, new)]
    together.forward(slots, [0] * 7, prompts, logits="none")
    lay = make_layout(slots, starts, steps, together.device)
    assert lay.split is not None and lay.split.multi.tolist() == [2, 4]
    got = together.forward(slots, starts, steps)                              # [sum(new), vocab]
    want = []
    for slot, prompt, start, toks in zip(slots, prompts, starts, steps):
        alone.forward([slot], [0], [prompt], logits="none")
        want.append(alone.forward([slot], [start], [toks]))
    torch.testing.assert_close(got, torch.cat(want), atol=3e-4, rtol=1e-4)
    # and the KV the split step wrote is what single-row steps write: the next step agrees too
    nxt = [[3], [4], [5, 6], [7], [8], [9], [10]]
    got = together.forward(slots, [s + n for s, n in zip(starts, new)], nxt)
    want = torch.cat([alone.forward([slot], [s + n], [t]) for slot, s, n, t in zip(slots, starts, new, nxt)])
    torch.testing.assert_close(got, want, atol=3e-4, rtol=1e-4)
