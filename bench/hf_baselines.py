"""Hugging Face `generate` baselines for the benchmark: static batching, assisted generation with a
draft model, prompt-lookup decoding, and plain batch-1 decoding. All greedy.

Each function takes a loaded model, its tokenizer and prompts already tokenized with the chat
template (bench.prompts.build_prompt_ids) and returns
    {"name", "tokens_per_s", "total_new_tokens", "wall_s", "num_prompts", "outputs"}
where outputs[i] holds the new tokens of prompt i, cut after the first EOS (the EOS itself kept,
as vLLM reports it), and wall_s covers the timed `generate` calls only: a short warm-up `generate`
runs first, outside the clock. Thread count (torch.set_num_threads) and dtype are the caller's.

This module knows nothing about our engine, prompt sets or vLLM.
"""
from __future__ import annotations

import time

import torch


def eos_ids(model) -> set[int]:
    """The model's EOS ids from its generation config (an int or a list there)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        raise ValueError("model.generation_config.eos_token_id is not set: greedy runs could not stop")
    return {eos} if isinstance(eos, int) else set(eos)


def cut_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    """ids up to and including the first EOS; everything after it (padding) dropped."""
    for i, tok in enumerate(ids):
        if tok in eos:
            return ids[: i + 1]
    return ids


def _pad_id(model, tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return min(eos_ids(model))


def _left_pad(batch: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask, both [batch, max_prompt_len]."""
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _generate(model, tokenizer, batch: list[list[int]], max_new_tokens: int, **kwargs) -> list[list[int]]:
    """One greedy `generate` call on a batch; returns each row's new tokens cut at EOS."""
    ids, mask = _left_pad(batch, _pad_id(model, tokenizer), model.device)
    eos = eos_ids(model)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=_pad_id(model, tokenizer),
                             eos_token_id=sorted(eos), **kwargs)  # [batch, width + new]
    return [cut_at_eos(row.tolist(), eos) for row in out[:, ids.shape[1]:]]


def _run(name: str, model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int,
         batch_size: int, warmup: bool, **kwargs) -> dict:
    """Warm up on the first prompt (4 tokens, untimed), then generate all batches in order, timed."""
    if warmup:
        _generate(model, tokenizer, prompt_ids[:1], 4, **kwargs)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompt_ids), batch_size):
        outputs += _generate(model, tokenizer, prompt_ids[i:i + batch_size], max_new_tokens, **kwargs)
    wall_s = time.perf_counter() - start
    total = sum(len(o) for o in outputs)
    return {"name": name, "tokens_per_s": total / wall_s, "total_new_tokens": total, "wall_s": wall_s,
            "num_prompts": len(prompt_ids), "outputs": outputs}


def hf_static_batch(model, tokenizer, prompt_ids, max_new_tokens, batch_size=16, warmup=True) -> dict:
    """Static batching: prompts in the given order, `batch_size` at a time, left-padded."""
    return _run(f"hf_static_b{batch_size}", model, tokenizer, prompt_ids, max_new_tokens, batch_size, warmup)


def hf_plain_batch1(model, tokenizer, prompt_ids, max_new_tokens, warmup=True) -> dict:
    """Plain greedy decoding, one prompt at a time."""
    return _run("hf_plain_b1", model, tokenizer, prompt_ids, max_new_tokens, 1, warmup)


def hf_assisted(model, draft, tokenizer, prompt_ids, max_new_tokens, warmup=True) -> dict:
    """Assisted generation with `draft` as assistant model (same tokenizer), batch 1 (HF's limit)."""
    return _run("hf_assisted_b1", model, tokenizer, prompt_ids, max_new_tokens, 1, warmup,
                assistant_model=draft)


def hf_prompt_lookup(model, tokenizer, prompt_ids, max_new_tokens, num_tokens=4, warmup=True) -> dict:
    """Prompt-lookup decoding (n-gram drafts from the context), `num_tokens` drafts, batch 1."""
    return _run(f"hf_prompt_lookup{num_tokens}_b1", model, tokenizer, prompt_ids, max_new_tokens, 1,
                warmup, prompt_lookup_num_tokens=num_tokens)
