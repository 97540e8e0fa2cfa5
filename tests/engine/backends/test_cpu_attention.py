"""Our CPU attention kernel (pipeline/engine/backends/cpu/attention.py, csrc/slot_attention.c): against the
plain-torch reference on ragged rows, through the runner against torch's padded SDPA, and the
cpu_attention switch. Its build cache: test_cpu_kernels.py. (The greedy-identity,
KV-invariant and chi-square tests run the engine on it too.)"""
import copy

import pytest
import torch

from conftest import tiny_llama
from pipeline.engine.backends.cpu import attention as cpu_attention
from pipeline.engine.core.tree import visible_inputs
from pipeline.engine.model.runner import build_runner

# Only a missing compiler skips: a kernel that builds but fails its self-check fails these tests.
pytestmark = pytest.mark.needs_cc


def ragged_case(dim, groups, kv_heads=2, seed=0):
    """Rows with non-contiguous slots, starts from 0 to near the capacity, 1 to 70 new tokens (a row
    of more than the kernel's 32-token task block is split over tasks)."""
    gen = torch.Generator().manual_seed(seed)
    cap = 96
    k_store = torch.randn(7, kv_heads, cap, dim, generator=gen)
    v_store = torch.randn(7, kv_heads, cap, dim, generator=gen)
    slots, starts, num_new = [5, 0, 3, 2, 4, 1], [0, 1, 37, 79, 8, 20], [1, 16, 7, 9, 8, 70]
    firsts = [sum(num_new[:i]) for i in range(len(num_new))]
    table = torch.tensor([slots, starts, num_new, firsts], dtype=torch.long)
    query = torch.randn(sum(num_new), kv_heads * groups, dim, generator=gen) * 3    # peaky softmax rows too
    return query, k_store, v_store, table


@pytest.mark.parametrize("dim,groups", [(64, 3), (128, 1), (16, 2), (24, 7)])
def test_kernel_equals_reference_on_ragged_rows(dim, groups):
    query, k_store, v_store, table = ragged_case(dim, groups)
    got = cpu_attention.kernel()(query, k_store, v_store, table, dim ** -0.5)
    want = cpu_attention.reference(query, k_store, v_store, table, dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)     # a mask off by one key: ~1e-1


@pytest.mark.parametrize("dim,groups", [(64, 3), (128, 1), (24, 7)])
def test_kernel_reads_bf16_stores(dim, groups):
    """A bf16 store is widened exactly: fp32 queries give the reference's output on the same bf16
    values to fp32 rounding; bf16 queries come back in bf16 (one rounding off). Reading the store's
    bytes as fp32, or widening into the wrong half, is off by orders of magnitude."""
    query, k_store, v_store, table = ragged_case(dim, groups, seed=1)
    k_store, v_store = k_store.bfloat16(), v_store.bfloat16()
    got = cpu_attention.kernel()(query, k_store, v_store, table, dim ** -0.5)
    want = cpu_attention.reference(query, k_store, v_store, table, dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got = cpu_attention.kernel()(query.bfloat16(), k_store, v_store, table, dim ** -0.5)
    want = cpu_attention.reference(query.bfloat16(), k_store, v_store, table, dim ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="expected both fp32 or bf16"):
        cpu_attention.kernel()(query, k_store, v_store.float(), table, dim ** -0.5)


@pytest.mark.parametrize("dim,groups", [(64, 1), (64, 2), (128, 4), (24, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_output_does_not_depend_on_its_step(dim, groups, dtype):
    """The kernel attends several queries at once (heads and tokens of a row), and those blocks span
    tokens when the heads per KV head do not fill one. Each token's output must still be bitwise
    what it is alone (fp32): verifying 4 drafts or 1 gives the same numbers for the same position;
    over a bf16 store, the same to fp32 rounding, and bitwise among tasks of few queries. A block
    that scores its shorter queries' last keys eight at a time, like its longest query's, fails this
    (the sums run in another order)."""
    query, k_store, v_store, _ = ragged_case(dim, groups, seed=2)
    k_store, v_store = k_store.to(dtype), v_store.to(dtype)
    if dtype == torch.bfloat16:
        query = query.to(dtype).float()                   # a bf16 model's queries
    start, n = 13, 30                     # positions 13..42: every residue of the key count mod 8
    kernel = cpu_attention.kernel()
    together = kernel(query[:n], k_store, v_store, torch.tensor([[1], [start], [n], [0]]), dim ** -0.5)
    for i in range(n):
        alone = kernel(query[i:i + 1], k_store, v_store, torch.tensor([[1], [start + i], [1], [0]]), dim ** -0.5)
        if dtype == torch.float32:
            assert torch.equal(together[i], alone[0]), f"token {i} (position {start + i})"
        else:        # AVX512_BF16 CPUs: a task of few queries takes the dot-product path, of many the widened one
            torch.testing.assert_close(together[i], alone[0], rtol=1e-5, atol=1e-6)
            if i + 2 <= n and groups <= 3:       # two tokens: still a task of few queries, bitwise as alone
                pair = kernel(query[i:i + 2], k_store, v_store, torch.tensor([[1], [start + i], [2], [0]]), dim ** -0.5)
                assert torch.equal(pair[0], alone[0]), f"token {i} (position {start + i})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_rows_split_over_threads(dtype):
    """With few rows the kernel splits a row's tokens into blocks by the thread count (so a batch-1
    tree step fills the threads) and widens a bf16 store once per block. Two tree rows of 17 and 3
    tokens and a causal row: the output equals the reference and is bitwise the same at 1, 2, 3 and 8
    threads (bf16: to fp32 rounding, where the blocks' sizes move them between the two paths). A block reading its tree bits from the row's first token, or widening keys short of
    the block's last token's, fails this."""
    gen = torch.Generator().manual_seed(3)
    dim, kv_heads, groups = 64, 3, 3
    k_store = torch.randn(3, kv_heads, 128, dim, generator=gen).to(dtype)
    v_store = torch.randn(3, kv_heads, 128, dim, generator=gen).to(dtype)
    parents = [[-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11], [-1, -1], None]
    num_new = [17, 3, 6]
    bits = torch.tensor([b for p, n in zip(parents, num_new) for b in (visible_inputs(p) if p else [-1] * n)])
    table = torch.tensor([[2, 0, 1], [40, 71, 9], num_new, [0, 17, 20]], dtype=torch.long)
    query = torch.randn(sum(num_new), kv_heads * groups, dim, generator=gen) * 3
    want = cpu_attention.reference(query, k_store, v_store, table, dim ** -0.5, bits)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            outs.append(cpu_attention.kernel()(query, k_store, v_store, table, dim ** -0.5, bits))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=1e-5)
    for out in outs[1:]:
        if dtype == torch.float32:
            assert torch.equal(out, outs[0])
        else:          # AVX512_BF16 CPUs: blocks of few queries (more threads) take the dot-product path
            torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


def test_first_position_sees_only_itself():
    """A token at position 0 attends to one key: its output is that key's value, exactly up to
    rounding. A mask one position off (seeing position 1's stale key) fails this."""
    query, k_store, v_store, table = ragged_case(64, 3)
    out = cpu_attention.kernel()(query, k_store, v_store, table, 0.125)
    slot = table[0, 0].item()                                       # row 0: start 0, one token
    torch.testing.assert_close(out[0], v_store[slot].repeat_interleave(3, 0)[:, 0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("length", [37, 40])
def test_rows_whose_every_score_is_very_negative(length):
    """Every key scores ~-240 (real models have such heads: Qwen2.5-1.5B does). The softmax is
    shift-invariant, so the output is still the reference's. A kernel that padded the last 8-key
    group with -87 took that as the row's maximum when the length is not a multiple of 8 (37) and
    was off by ~2; found on Qwen's real logits (5.2 off), not by random inputs."""
    gen = torch.Generator().manual_seed(0)
    k_store = torch.randn(1, 1, 48, 64, generator=gen) * 0.1 - 1.0
    v_store = torch.randn(1, 1, 48, 64, generator=gen)
    query = torch.full((1, 1, 64), 30.0) + torch.randn(1, 1, 64, generator=gen)
    table = torch.tensor([[0], [length - 1], [1], [0]])
    got = cpu_attention.kernel()(query, k_store, v_store, table, 0.125)
    want = cpu_attention.reference(query, k_store, v_store, table, 0.125)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_runner_logits_equal_padded_sdpa():
    """A verify-shaped step (rows of 1 to 5 tokens, non-contiguous slots, mixed lengths) through the
    model: the kernel's logits equal torch's padded SDPA path's."""
    model = tiny_llama(hidden=128, heads=4, kv_heads=2)                 # head size 32
    runners = {mode: build_runner(copy.deepcopy(model), 6, 200, packed_linear=False, cpu_attention=mode)
               for mode in ("on", "off")}
    assert runners["on"].cpu_attention is not None and runners["off"].cpu_attention is None
    gen = torch.Generator().manual_seed(1)
    prompts = {slot: torch.randint(0, 512, (n,), generator=gen).tolist() for slot, n in [(4, 150), (1, 9), (3, 60)]}
    out = {}
    for mode, runner in runners.items():
        runner.forward(list(prompts), [0] * 3, list(prompts.values()), logits="none")        # prefill: SDPA
        step = [[7, 8, 9, 10, 11], [12], [13, 14]]
        out[mode] = runner.forward(list(prompts), [len(p) for p in prompts.values()], step)
    torch.testing.assert_close(out["on"], out["off"], atol=1e-4, rtol=1e-4)


def test_modes():
    cpu = torch.device("cpu")
    assert cpu_attention.policy("off", cpu, torch.float32, 64) is None
    assert cpu_attention.policy("auto", cpu, torch.float32, 64) is not None
    assert cpu_attention.policy("auto", cpu, torch.bfloat16, 64) is not None            # bf16 stores too
    assert cpu_attention.policy("auto", cpu, torch.float16, 64) is None                 # torch's kernels then
    with pytest.raises(RuntimeError, match="float16"):
        cpu_attention.policy("on", cpu, torch.float16, 64)
    with pytest.raises(RuntimeError, match="head size 20"):
        cpu_attention.policy("on", cpu, torch.float32, 20)
    with pytest.raises(ValueError, match="cpu_attention"):
        cpu_attention.policy("maybe", cpu, torch.float32, 64)


@pytest.mark.parametrize("long_kind,dtype", [("sdpa", torch.float32), ("sdpa", torch.bfloat16),
                                              pytest.param("amx", torch.bfloat16, marks=pytest.mark.amx_bf16)])
def test_row_attention_splits_rows_between_the_kernels(long_kind, dtype):
    """Rows of >= 8 new tokens through SDPA (from position 0: causal; from later positions: a mask over
    the stored keys) or our AMX kernel, shorter ones through our kernel, tree bits through ours alone
    beside SDPA and through the AMX kernel too: all as the reference (the AMX kernel's rows as the
    reference that rounds the numerators as it does)."""
    from pipeline.engine.backends.cpu.attention import RowAttention, amx_kernel, kernel, reference
    gen = torch.Generator().manual_seed(5)
    dim = 32 if long_kind == "amx" else 16
    k_store = torch.randn(4, 2, 64, dim, generator=gen).to(dtype)
    v_store = torch.randn(4, 2, 64, dim, generator=gen).to(dtype)
    slots, starts, num_new = [2, 0, 3, 1], [0, 20, 30, 5], [12, 1, 9, 3]
    firsts = [0, 12, 13, 22]
    table = torch.tensor([slots, starts, num_new, firsts], dtype=torch.long)
    query = torch.randn(sum(num_new), 6, dim, generator=gen).to(dtype)
    bits = torch.full((25,), -1, dtype=torch.long)
    bits[13:17] = torch.tensor(visible_inputs([-1, 0, 0]))              # row 2 (9 tokens at 30) starts with a tree
    split = RowAttention(kernel(), 8, amx_kernel() if long_kind == "amx" else None)
    assert split.long_kind == long_kind
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for t in (table, table[:, [0, 2]].contiguous(), table[:, [1, 3]].contiguous()):  # mixed, all long, all short
        for b in (None, bits):
            got = split(query, k_store, v_store, t, 0.25, b)
            for slot, start, n, first in t.T.tolist():
                rounded = long_kind == "amx" and n >= 8
                want = reference(query, k_store, v_store, t, 0.25, b, rounded_p=rounded)
                torch.testing.assert_close(got[first:first + n].float(), want[first:first + n].float(),
                                           rtol=tol, atol=tol)


amx = pytest.mark.amx_bf16


def _bf16_case(dim, groups, seed=0):
    query, k_store, v_store, table = ragged_case(dim, groups, seed=seed)
    return query.bfloat16(), k_store.bfloat16(), v_store.bfloat16(), table


@amx
@pytest.mark.parametrize("dim,groups", [(64, 3), (128, 1), (32, 2), (256, 2)])
def test_amx_kernel_equals_the_reference_that_rounds_alike(dim, groups):
    """Ragged rows (1 to 70 new tokens, starts up to near the capacity, a row over the 64-token task
    block), against the reference with the numerators rounded to bf16: within the output's last bit;
    against the fp32 softmax's reference the difference is that rounding, far below a wrong key's."""
    query, k_store, v_store, table = _bf16_case(dim, groups)
    got = cpu_attention.amx_kernel()(query, k_store, v_store, table, dim ** -0.5).float()
    want = cpu_attention.reference(query, k_store, v_store, table, dim ** -0.5, rounded_p=True).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2 ** -7)
    plain = cpu_attention.reference(query, k_store, v_store, table, dim ** -0.5).float()
    off_by_one = table.clone()
    off_by_one[1] += 1                                       # every token one key further: a wrong mask
    wrong = cpu_attention.reference(query, k_store, v_store, off_by_one, dim ** -0.5).float()
    assert (got - plain).abs().max() < 0.1 < (wrong - plain).abs().max()


@amx
def test_amx_kernel_masks_token_trees():
    """A tree row (a root, two children of it, a grandchild): each token sees its ancestors only, as the
    reference with the same bits, and differently from the causal row it would otherwise be."""
    query, k_store, v_store, table = _bf16_case(64, 3, seed=2)
    bits = torch.full((query.shape[0],), -1, dtype=torch.long)
    slot, start, first = table[0, 2].item(), table[1, 2].item(), table[3, 2].item()   # the row of 7 at 37
    bits[first:first + 4] = torch.tensor(visible_inputs([-1, -1, 0]))
    # token 1's key close to token 2's first query heads and its value large: plain to see where it is seen
    v_store[slot, :, start + 1] = 30.0
    k_store[slot, :, start + 1] = query[first + 2, ::3]
    got = cpu_attention.amx_kernel()(query, k_store, v_store, table, 0.125, bits).float()
    want = cpu_attention.reference(query, k_store, v_store, table, 0.125, bits, rounded_p=True).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2 ** -7)
    causal = cpu_attention.amx_kernel()(query, k_store, v_store, table, 0.125).float()
    assert (got[first + 2] - causal[first + 2]).abs().max() > 1.0       # token 2 does not see token 1
    assert torch.equal(got[first + 1], causal[first + 1])               # token 1 sees what a causal row sees


@amx
def test_amx_kernel_writes_only_its_rows_and_refuses_what_it_cannot_take():
    query, k_store, v_store, table = _bf16_case(64, 3)
    out = torch.full_like(query, 7.0)
    cpu_attention.amx_kernel().into(out, query, k_store, v_store, table[:, [2]].contiguous(), 0.125)
    first, n = table[3, 2].item(), table[2, 2].item()
    assert bool((out[:first] == 7).all()) and bool((out[first + n:] == 7).all())
    assert not bool((out[first:first + n] == 7).any())
    with pytest.raises(ValueError, match="bf16"):
        cpu_attention.amx_kernel()(query.float(), k_store, v_store, table, 0.125)
    cpu = torch.device("cpu")
    assert "bf16 stores" in cpu_attention.amx_unavailable(cpu, torch.float32, 64)
    assert "multiples of 32" in cpu_attention.amx_unavailable(cpu, torch.bfloat16, 48)
    assert cpu_attention.amx_unavailable(cpu, torch.bfloat16, 64) is None
