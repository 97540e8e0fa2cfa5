"""The same engine on CUDA, unchanged (device from config). Skipped where no CUDA device exists;
run on the lent GPU machine."""
import pytest
import torch

from conftest import greedy_reference, make_engine, mixed_prompts, run_requests, noisy_copy, tiny_llama
from pipeline.engine import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("kind", ["none", "ngram", "draft-greedy", "draft-prob"])
def test_greedy_identity_on_cuda(kind):
    cpu_target = tiny_llama()
    prompts = mixed_prompts(16, cpu_target.config.vocab_size, seed=2)
    refs = [greedy_reference(cpu_target, p, 16) for p in prompts]
    target = tiny_llama().cuda()
    draft = noisy_copy(tiny_llama(), 0.05).cuda()
    engine = make_engine(target, kind, draft, max_num_seqs=8, max_model_len=128, g=4)
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=16, temperature=0), arrive_every=2)
    same = sum(done[str(i)].output_ids == ref for i, ref in enumerate(refs))
    assert same >= len(prompts) - 1      # fp32 CUDA vs CPU kernels: at most one near-tie flip
    assert engine.target.cache.keys[0].is_cuda


def test_sampling_runs_on_cuda():
    target = tiny_llama().cuda()
    engine = make_engine(target, "draft-prob", noisy_copy(tiny_llama(), 0.05).cuda(), max_num_seqs=4)
    done, _ = run_requests(engine, mixed_prompts(6, 512, seed=1), SamplingParams(max_tokens=12, temperature=0.8))
    assert all(len(c.output_ids) == 12 for c in done.values())
