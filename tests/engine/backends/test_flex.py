"""The compiled FlexAttention path (pipeline/engine/backends/flex.py): block tables against a dense mask, the
kernel against masked SDPA, the per-step kernel choice, and the compile modes."""
import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_llama
from pipeline.engine.backends import flex as flex_mod
from pipeline.engine.backends.flex import BLOCK, block_tables, capacity, prefer_flex, slot_flex_attention
from pipeline.engine.model.plan import flex_policy
from pipeline.engine.model.runner import build_runner


def dense_allowed(slot_start, slot_new, max_q, cap):
    """[num_slots, max_q, cap] bool: query q of slot s (a real one) sees keys <= start + q."""
    q = torch.arange(max_q).view(1, -1, 1)
    keys = torch.arange(cap).view(1, 1, -1)
    real = q < slot_new.view(-1, 1, 1)
    return real & (keys <= slot_start.view(-1, 1, 1) + q)


@pytest.mark.parametrize("max_q", [1, 5, 130])
def test_block_tables_cover_exactly_the_allowed_keys(max_q):
    gen = torch.Generator().manual_seed(max_q)
    num_slots, cap = 9, 4 * BLOCK
    slots = torch.tensor([7, 2, 4, 0, 5])                            # not contiguous, not sorted
    num_new = torch.randint(1, max_q + 1, (5,), generator=gen)
    starts = torch.stack([torch.randint(0, int(cap - n), (1,), generator=gen)[0] for n in num_new])
    partial_num, partial_idx, full_num, full_idx, slot_start = block_tables(slots, starts, num_new, num_slots,
                                                                            max_q, cap // BLOCK)
    slot_new = torch.zeros(num_slots, dtype=torch.long).index_copy_(0, slots, num_new)
    allowed = dense_allowed(slot_start, slot_new, max_q, cap)
    for s in range(num_slots):
        for qb in range(partial_num.shape[2]):
            rows = allowed[s, qb * BLOCK:(qb + 1) * BLOCK]                 # [<=BLOCK, cap]
            per_block = rows.reshape(rows.shape[0], cap // BLOCK, BLOCK)
            real = torch.arange(qb * BLOCK, qb * BLOCK + rows.shape[0]) < slot_new[s]
            full = [b for b in range(cap // BLOCK) if real.any() and per_block[real][:, b].all()]
            some = [b for b in range(cap // BLOCK) if per_block[:, b].any()]
            n_full, n_part = int(full_num[s, 0, qb]), int(partial_num[s, 0, qb])
            assert full_idx[s, 0, qb, :n_full].tolist() == full
            listed = set(full) | set(partial_idx[s, 0, qb, :n_part].tolist())
            assert set(some) <= listed, "an allowed key block is never read"
            assert len(listed) <= len(some) + 1 and not set(full) & set(partial_idx[s, 0, qb, :n_part].tolist())


def assert_matches_sdpa(got, query, keys, values, slots, starts, token_row, token_q, scale, window=None):
    """Each packed token's output (token t: row token_row[t]'s query token_q[t], at starts[row] + q) against
    SDPA over its slot's keys up to itself (the last `window` of them where given)."""
    groups = query.shape[1] // keys.shape[1]
    for t, (b, q) in enumerate(zip(token_row.tolist(), token_q.tolist())):
        s, end = int(slots[b]), int(starts[b]) + q + 1
        begin = 0 if window is None else end - window
        k = keys[s, :, begin:end].repeat_interleave(groups, 0)
        v = values[s, :, begin:end].repeat_interleave(groups, 0)
        want = F.scaled_dot_product_attention(query[0, :, t:t + 1], k, v, scale=scale)[:, 0]   # [heads, dim]
        torch.testing.assert_close(got[t], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("max_q", [1, 5, 130])
def test_kernel_matches_masked_sdpa(max_q):
    gen = torch.Generator().manual_seed(10 + max_q)
    num_slots, kv_heads, heads, dim, cap = 6, 2, 4, 16, capacity(300)
    keys = torch.randn(num_slots, kv_heads, cap, dim, generator=gen)
    values = torch.randn(num_slots, kv_heads, cap, dim, generator=gen)
    slots = torch.tensor([4, 1, 3])
    num_new = torch.tensor([max_q, max(1, max_q // 2), 1])
    starts = torch.tensor([cap - max_q, 7, 150])
    token_row, token_q = (torch.arange(max_q).unsqueeze(0) < num_new.unsqueeze(1)).nonzero(as_tuple=True)
    query = torch.randn(1, heads, len(token_row), dim, generator=gen)
    tables = block_tables(slots, starts, num_new, num_slots, max_q, cap // BLOCK)
    got = slot_flex_attention(query, keys, values, slots[token_row], token_q, tables, max_q, 0.25)[0]
    assert_matches_sdpa(got, query, keys, values, slots, starts, token_row, token_q, 0.25)


def test_kernel_choice_follows_padding_waste():
    cpu = torch.device("cpu")
    assert prefer_flex([1505] + [150 + 3 * i for i in range(31)], cpu)      # one long row among short ones
    assert not prefer_flex([150 + 3 * i for i in range(32)], cpu)          # even lengths: padded SDPA
    assert not prefer_flex([40], cpu)
    assert prefer_flex([200, 1000], torch.device("cuda"))                   # even cost assumed on CUDA


def test_compile_modes(monkeypatch):
    cpu = torch.device("cpu")
    assert flex_policy("off", cpu) is None
    assert flex_policy("on", cpu) == "always"
    assert flex_policy("auto", cpu) == "cheaper"
    with pytest.raises(ValueError, match="engine.compile"):
        flex_policy("yes", cpu)
    monkeypatch.setattr(flex_mod.shutil, "which", lambda name: None)
    assert flex_policy("auto", cpu) is None                                 # falls back to eager
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        flex_policy("on", cpu)


@pytest.mark.slow
@pytest.mark.parametrize("compile", ["on", "auto"])
def test_runner_logits_equal_eager(compile):
    """The same forwards through both kernels (auto picks flex for the mixed step only): same logits."""
    model = tiny_llama()
    runners = {mode: build_runner(copy.deepcopy(model), 4, 600, packed_linear=False, compile=mode, cpu_attention="off")
               for mode in ("off", compile)}
    gen = torch.Generator().manual_seed(3)
    history = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (520, 30, 40, 35)]
    for runner in runners.values():
        runner.forward([0, 1, 2, 3], [0] * 4, [h[:-3] for h in history], logits="none")
    steps = [([0, 1, 2, 3], [len(h) - 3 for h in history], [h[-3:] for h in history]),   # mixed lengths
             ([1, 3], [len(history[1]) - 3, len(history[3]) - 3], [history[1][-3:], history[3][-3:]])]
    for slots, starts, tokens in steps:
        out = {mode: runner.forward(slots, starts, tokens) for mode, runner in runners.items()}
        torch.testing.assert_close(out[compile], out["off"], atol=1e-4, rtol=1e-4)


def test_compile_key_in_yaml_and_overrides(tmp_path):
    """A bare on/off is a YAML 1.1 boolean: it still means the mode; anything else is named."""
    from pipeline.errors import ConfigError
    from pipeline.job.config import load_config
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  compile: off\n")
    assert load_config(str(path)).engine.compile == "off"
    assert load_config(str(path), ["engine.compile=on"]).engine.compile == "on"
    assert load_config(None, []).engine.compile == "auto"
    with pytest.raises(ConfigError, match="engine.compile"):
        load_config(str(path), ["engine.compile=maybe"])


@pytest.mark.slow
def test_many_head_sizes_in_one_process():
    """Every model in one process shares the compiled kernel: scales are data, not graph constants,
    and past dynamo's recompile limit the kernel still runs (CI once failed on the ninth variant)."""
    cap = capacity(200)
    slots, starts, num_new = torch.tensor([0, 2]), torch.tensor([10, 50]), torch.tensor([3, 2])
    token_row, token_q = (torch.arange(3).unsqueeze(0) < num_new.unsqueeze(1)).nonzero(as_tuple=True)
    tables = block_tables(slots, starts, num_new, 4, 3, cap // BLOCK)
    for i, scale in enumerate([0.2 + 0.01 * i for i in range(12)]):
        dim = 16 if i % 3 else 32
        gen = torch.Generator().manual_seed(i)
        keys, values = torch.randn(2, 4, 2, cap, dim, generator=gen)
        query = torch.randn(1, 4, len(token_row), dim, generator=gen)
        got = slot_flex_attention(query, keys, values, slots[token_row], token_q, tables, 3, scale)[0]
        assert_matches_sdpa(got, query, keys, values, slots, starts, token_row, token_q, scale)


@pytest.mark.parametrize("max_q,tree", [(1, False), (5, False), (130, False), (5, True)])
def test_window_blocks_read_every_key_in_a_window_and_skip_the_rest(max_q, tree):
    """A windowed layer's blocks: every block holding a key some query's window sees is read, and at long
    context the blocks wholly before every window are not (a query block reads at most the blocks its
    windows span, plus one)."""
    gen = torch.Generator().manual_seed(20 + max_q)
    num_slots, cap, window = 9, 6 * BLOCK, 40
    slots = torch.tensor([7, 2, 4, 0, 5])
    num_new = torch.randint(1, max_q + 1, (5,), generator=gen)
    starts = torch.tensor([cap - max_q, 3, 2 * BLOCK + 17, BLOCK - 1, 4 * BLOCK])
    tables = block_tables(slots, starts, num_new, num_slots, max_q, cap // BLOCK, tree=tree)
    partial_num, partial_idx = flex_mod.window_blocks(tables[0], tables[2], tables[4], torch.tensor(window), max_q,
                                                      cap // BLOCK, tree=tree)
    slot_new = torch.zeros(num_slots, dtype=torch.long).index_copy_(0, slots, num_new)
    q = torch.arange(max_q).view(1, -1, 1)
    keys = torch.arange(cap).view(1, 1, -1)
    # a tree's inputs may sit at any depth from the start: the window of the shallowest bounds them
    lowest = tables[4].view(-1, 1, 1) + (torch.zeros_like(q) if tree else q)
    allowed = dense_allowed(tables[4], slot_new, max_q, cap) & (keys > lowest - window)
    skipped = 0
    for s in range(num_slots):
        for qb in range(partial_num.shape[2]):
            rows = allowed[s, qb * BLOCK:(qb + 1) * BLOCK].reshape(-1, cap // BLOCK, BLOCK)
            some = {b for b in range(cap // BLOCK) if rows[:, b].any()}
            listed = set(partial_idx[s, 0, qb, :int(partial_num[s, 0, qb])].tolist())
            assert some <= listed, "a key block some window sees is never read"
            assert len(listed) <= len(some) + 1
            skipped += int(tables[0][s, 0, qb] + tables[2][s, 0, qb]) - len(listed)
    assert skipped > 0, "no block was skipped: the window never bit"


def test_windowed_kernel_matches_masked_sdpa_at_long_context():
    """A sliding window over keys several blocks long, skipped blocks and all, against SDPA over each
    query's window."""
    gen = torch.Generator().manual_seed(31)
    num_slots, kv_heads, heads, dim, cap, window, max_q = 4, 2, 4, 16, capacity(700), 50, 3
    keys = torch.randn(num_slots, kv_heads, cap, dim, generator=gen)
    values = torch.randn(num_slots, kv_heads, cap, dim, generator=gen)
    slots, num_new, starts = torch.tensor([3, 0]), torch.tensor([3, 1]), torch.tensor([690, 260])
    token_row, token_q = (torch.arange(max_q).unsqueeze(0) < num_new.unsqueeze(1)).nonzero(as_tuple=True)
    query = torch.randn(1, heads, len(token_row), dim, generator=gen)
    tables = block_tables(slots, starts, num_new, num_slots, max_q, cap // BLOCK)
    positions = starts[token_row] + token_q
    got = slot_flex_attention(query, keys, values, slots[token_row], token_q, tables, max_q, 0.25,
                              features=(None, window, positions))[0]
    assert_matches_sdpa(got, query, keys, values, slots, starts, token_row, token_q, 0.25, window)
