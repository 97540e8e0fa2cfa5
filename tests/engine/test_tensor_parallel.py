"""Tensor parallel in the engine: a replica of 2 ranks (rank 0 here, rank 1 a spawned process that
loads its slices from safetensors; gloo between them) runs the round's code unchanged.

- Greedy identity: every drafter (and suffix trees), batch 1 and 16 with rows arriving mid-run, gives
  the target's greedy tokens (HF generate on the whole model); a difference must sit on a near-tie
  (top-2 gap < 1e-3: the all-reduce sums in another order than one device does).
- KV: after a run with rejections (a noisy draft model), each rank's slot store equals the matching
  KV-head slice of a one-rank run's store, position by position (rollback acts on every rank), at 2
  ranks and at 4 (fewer KV heads than ranks: each rank keeps the one its queries read).
- Loading: a rank reads only its slices, holding each split weight's 1/N part (bytes held, exactly).
- Refusals: models that cannot be split so name the key and the model's numbers.
Sampled exactness at 2 ranks is the exactness matrix's (test_exactness_matrix.py, TP_CELLS)."""
import copy

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, Qwen2Config

from conftest import (DRAFTERS, greedy_references_fixture, make_engine, mixed_prompts_fixture, near_tie_mismatches,
                      noisy_copy, run_requests, tiers, tiny_llama)
from pipeline.engine import SamplingParams, TreeParams
from pipeline.engine.model.runner import weight_bytes
from pipeline.engine.parallel.shard import Split, shard_model
from pipeline.errors import ConfigError
from pipeline.job.config import ModelsConfig
from pipeline.loading.models import ModelSpec
from pipeline.loading.shards import load_model_shard
from tp_util import Replica, save_model

NUM_PROMPTS, MAX_NEW = 24, 16
prompts = mixed_prompts_fixture(NUM_PROMPTS, seed=11)
references = greedy_references_fixture(MAX_NEW)


@pytest.fixture(scope="module")
def target_dir(target_model, tmp_path_factory):
    return save_model(target_model, tmp_path_factory.mktemp("tp-target"))


@pytest.fixture(scope="module")
def replica(target_dir):
    r = Replica(target_dir, 2)
    yield r
    assert r.close() == [0]


GRID = ([(kind, 16, "cpu-loop") for kind in (*DRAFTERS, "suffix-tree")]
        + [("none", 1, "cpu-loop"), ("draft-prob", 1, "cpu-loop"), ("hybrid", 16, "modules"), ("none", 1, "modules")])


@pytest.mark.parametrize("kind,batch_size,decoder", tiers(GRID, {("hybrid", 16, "cpu-loop"), ("hybrid", 16, "modules")}))
def test_greedy_identity_at_two_ranks(replica, target_model, draft_model, prompts, references, kind, batch_size,
                                      decoder):
    """decoder: the forward as our CPU loop (its collectives called in the loop) or the model's modules
    (in their forward hooks); rank 1 takes the path rank 0 took."""
    tree = TreeParams(max_tokens=6, max_branches=3) if kind == "suffix-tree" else TreeParams()
    engine = make_engine(replica.shard(target_model), kind.removesuffix("-tree"), draft_model,
                         max_num_seqs=batch_size, max_model_len=128, tree=tree, tp=replica.tp,
                         cpu_decoder="on" if decoder == "cpu-loop" else "off")
    assert engine.target.plan.decoder == decoder
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0), arrive_every=3)
    outputs = [done[str(i)].output_ids for i in range(NUM_PROMPTS)]
    assert near_tie_mismatches(target_model, prompts, outputs, references) <= 1
    if kind != "none":
        assert sum(r.accepted for r in rounds) > 0 and sum(r.draft_len - r.accepted for r in rounds) > 0
    if kind == "suffix-tree":
        assert any(r.paths > 1 for r in rounds)
    assert max(r.batch_size for r in rounds) == 1 if batch_size == 1 else max(r.batch_size for r in rounds) > 8


@pytest.mark.parametrize("size", tiers([2, 4], {2}))
def test_each_rank_holds_its_heads_of_the_one_rank_store(target_model, draft_model, target_dir, tmp_path, size):
    """Equal-length prompts, 8 at once, 12 tokens each, drafts of a noisy copy (rejections): at the end every
    slot holds one sequence's first P + 12 - 1 positions, which must match across the runs."""
    gen = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, 512, (9,), generator=gen).tolist() for _ in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0)
    one = make_engine(target_model, "draft-greedy", draft_model, max_num_seqs=8, max_model_len=64, prefix_reuse=False)
    done_one, rounds = run_requests(one, batch, params)
    assert sum(r.draft_len - r.accepted for r in rounds) > 0, "the run must roll back rejected drafts"
    r = Replica(target_dir, size, dump_dir=tmp_path)
    try:
        many = make_engine(r.shard(target_model), "draft-greedy", draft_model, max_num_seqs=8, max_model_len=64,
                           prefix_reuse=False, tp=r.tp)
        done_many, _ = run_requests(many, batch, params)
        stores = {0: (many.target.cache.keys, many.target.cache.values)}
    finally:
        assert r.close() == [0] * (size - 1)
    assert {k: c.output_ids for k, c in done_many.items()} == {k: c.output_ids for k, c in done_one.items()}
    for rank in range(1, size):
        dumped = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        layers = len(one.target.cache.keys)
        stores[rank] = ([dumped[f"k{i}"] for i in range(layers)], [dumped[f"v{i}"] for i in range(layers)])
    valid = 9 + 12 - 1
    for rank, (keys, values) in stores.items():
        heads = Split.of(target_model.config, size, rank).kv
        for whole, part in zip(one.target.cache.keys + one.target.cache.values, keys + values):
            expected = whole[:, heads.start:heads.stop, :valid]
            torch.testing.assert_close(part[:, :, :valid], expected, atol=1e-4, rtol=1e-4)


def part_bytes(model, split: Split) -> int:
    """Bytes of `split`'s part of the model: each split weight's slice (1/N; a KV projection at fewer KV
    heads than ranks, its one head), each other weight whole."""
    def held(name, p):
        part = split.slice_of(name)
        return p.numel() * p.element_size() * ((part[2] - part[1]) / p.shape[part[0]] if part else 1)
    return int(sum(held(n, p) for n, p in model.named_parameters(remove_duplicate=False)))


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_reads_only_its_slices(target_model, target_dir, size):
    """Each rank's parameters, read by slices, equal its part of the whole model cut in memory; its bytes
    are the split weights' 1/size part plus the replicated ones (and the rank's sizes in its config)."""
    whole = dict(target_model.named_parameters(remove_duplicate=False))
    for rank in range(size):
        expected = part_bytes(target_model, Split.of(target_model.config, size, rank))
        model, _, split = load_model_shard(ModelSpec(str(target_dir), "float32"), size, rank)
        cut = shard_model(copy.deepcopy(target_model), Split.of(target_model.config, size, rank))
        read = dict(model.named_parameters(remove_duplicate=False))
        assert read.keys() == whole.keys()
        for name, p in dict(cut.named_parameters(remove_duplicate=False)).items():
            torch.testing.assert_close(read[name], p, rtol=0, atol=0)
        assert weight_bytes(model) == expected < sum(p.numel() * p.element_size() for p in whole.values())
        assert model.config.num_attention_heads == 4 // size and model.config.num_key_value_heads == len(split.kv)


def test_the_one_rank_bytes_of_a_tied_head_are_its_vocabulary_part(tmp_path):
    """A tied LM head: the embedding stays whole, the head holds its vocabulary part, read from the
    embedding's tensor (the checkpoint has no head)."""
    model = tiny_llama(vocab=512)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    folder = save_model(model, tmp_path)
    part, _, _ = load_model_shard(ModelSpec(str(folder), "float32"), 2, 1)
    embed = model.model.embed_tokens.weight
    torch.testing.assert_close(part.lm_head.weight, embed[256:], rtol=0, atol=0)
    torch.testing.assert_close(part.model.embed_tokens.weight, embed, rtol=0, atol=0)


@pytest.mark.parametrize("cfg,size,words", [
    (LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, intermediate_size=1536,
                 vocab_size=49152), 2, "num_attention_heads 9 is not divisible by 2"),
    (LlamaConfig(num_attention_heads=6, num_key_value_heads=3, hidden_size=384, intermediate_size=1536,
                 vocab_size=49152), 2, "num_key_value_heads 3"),
    (Qwen2Config(num_attention_heads=14, num_key_value_heads=2, hidden_size=896, intermediate_size=4864,
                 vocab_size=151937), 2, "vocab_size 151937 is not divisible by 2"),
    (LlamaConfig(num_attention_heads=16, num_key_value_heads=8, hidden_size=512, intermediate_size=1000,
                 vocab_size=32000), 16, "intermediate_size 1000 is not divisible by 16"),
])
def test_a_model_that_cannot_be_split_is_refused_naming_the_key_and_its_numbers(cfg, size, words):
    with pytest.raises(ValueError, match="models.tensor_parallel_size") as e:
        Split.of(cfg, size)
    assert words in str(e.value)


def test_the_size_is_a_whole_number_of_ranks():
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ConfigError, match="models.tensor_parallel_size"):
            ModelsConfig(tensor_parallel_size=bad)
