"""Token trees in every attention path: a tree row's logits at each token equal those of the single
path from the root to that token, computed as an ordinary causal row in another slot; and after
`move_path` keeps one path, the next forward continues as if only that path had been computed.

Paths: our CPU kernel in the decoder loop and under the model's modules, torch's padded SDPA (whole
and split in two, when few rows have more than one token), compiled FlexAttention, and the CUDA
graphs' padded forward run uncaptured (how the CPU checks that path).
"""
import copy

import pytest
import torch

from conftest import tiny_llama
from pipeline.engine.backends.cuda.graphs import UNCAPTURED
from pipeline.engine.core.tree import path_to
from pipeline.engine.model.runner import build_runner

VOCAB = 256
PATHS = {
    "cpu-decoder": dict(cpu_attention="on", cpu_decoder="on"),
    "cpu-modules": dict(cpu_attention="on", cpu_decoder="off"),
    "sdpa": dict(cpu_attention="off"),
    "flex": dict(cpu_attention="off", compile="on"),
    "graphs": dict(cpu_attention="off", cuda_graphs=UNCAPTURED, packed_linear=False),
}
PARENTS = [-1, -1, 0, 0, 1, 2, 2, 5, -1, 4]          # 10 tokens: three root children, depth up to 4


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=VOCAB, seed=7)


def prefill(runner, slot: int, prompt: list[int]) -> None:
    runner.forward([slot], [0], [prompt[:-1]], logits="none")


@pytest.mark.parametrize("others", [1, 3], ids=["with-a-chain-row", "split"])
@pytest.mark.parametrize("path", list(PATHS))
def test_tree_logits_equal_each_paths_logits(model, path, others):
    runner = build_runner(copy.deepcopy(model), 8, 128, **PATHS[path])
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (21,), generator=gen).tolist()
    tokens = torch.randint(0, VOCAB, (len(PARENTS),), generator=gen).tolist()
    root, start = prompt[-1], len(prompt) - 1
    prefill(runner, 0, prompt)
    # the other rows of the step: one chain of 3 tokens, or 3 rows of 1 (then SDPA splits)
    other_prompts = [torch.randint(0, VOCAB, (9 + 4 * i,), generator=gen).tolist() for i in range(others)]
    for i, p in enumerate(other_prompts):
        prefill(runner, 1 + i, p)
    other_tokens = [[p[-1]] + ([5, 6] if others == 1 else []) for p in other_prompts]
    logits = runner.forward([0] + [1 + i for i in range(others)], [start] + [len(p) - 1 for p in other_prompts],
                            [[root] + tokens] + other_tokens, parents=[PARENTS] + [None] * others)
    tree_logits = logits[:len(PARENTS) + 1]
    # each token's path as an ordinary row in a slot of its own
    for node in range(-1, len(PARENTS)):
        path = [tokens[j] for j in path_to(PARENTS, node)]
        prefill(runner, 7, prompt)
        want = runner.forward([7], [start], [[root] + path])[-1]
        torch.testing.assert_close(tree_logits[node + 1], want, atol=5e-4, rtol=1e-3, msg=f"{path}: token {node}")
    # the other rows are unaffected by sharing the step with a tree
    at = len(PARENTS) + 1
    for i, (p, toks) in enumerate(zip(other_prompts, other_tokens)):
        prefill(runner, 7, p)
        want = runner.forward([7], [len(p) - 1], [toks])
        torch.testing.assert_close(logits[at:at + len(toks)], want, atol=5e-4, rtol=1e-3)
        at += len(toks)


@pytest.mark.parametrize("path", list(PATHS))
def test_the_kept_path_continues_as_if_alone(model, path):
    runner = build_runner(copy.deepcopy(model), 4, 128, **PATHS[path])
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (15,), generator=gen).tolist()
    tokens = torch.randint(0, VOCAB, (len(PARENTS),), generator=gen).tolist()
    root, start = prompt[-1], len(prompt) - 1
    for node in (7, 9, 3):                         # depth 4 through 0-2-5-7, depth 4 through 1-4-9, depth 2
        prefill(runner, 0, prompt)
        runner.forward([0], [start], [[root] + tokens], parents=[PARENTS])
        kept = path_to(PARENTS, node)
        runner.move_path([0], [start], [[j + 1 for j in kept]])
        nxt = [tokens[j] for j in kept]
        got = runner.forward([0], [start + 1 + len(kept)], [[11, 12]])          # two tokens after the path
        prefill(runner, 1, prompt)
        want = runner.forward([1], [start], [[root] + nxt + [11, 12]])[-2:]
        torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-3)
