"""GPU throughput check: the engine on one device against Hugging Face `generate`, each figure next to its
floor, in parts ordered by what a spent budget should cost least:

1. batch 1, ours against HF `generate` with its static cache, per model: the same prompts, greedy, the same
   new tokens (EOS ignored: min_new_tokens). transformers compiles the static-cache decode step on CUDA
   (torch.compile, mode reduce-overhead: CUDA graphs); ours runs compile on, CUDA graphs on, steps run
   ahead (engine.run_ahead auto), and again with run_ahead off (each step read back before the next).
2. plain decoding (drafter none, the same setting) with 64 and 256 sequences at once, per model.
3. torch.profiler over a few decode steps of the last model (the Llama-3-8B shape) at batch 1 and 64:
   kernels and launch calls per step, the 10 kernels with the most device time, the device's idle time
   per step (on a CPU: the ops with the most self time).
4. as budget allows: drafter none / ngram (a single path) / ngram-tree (16 tokens verified per row),
   compile off/on (eager attention / compiled FlexAttention), CUDA graphs on/off, batch 1 and 64 at once.

    python3 -m bench.gpu_bench                              # random-init SmolLM2-135M, Qwen2.5-1.5B, Llama-3-8B shapes
    python3 -m bench.gpu_bench --model-dir DIR [DIR ...]    # real checkpoints (HF safetensors directories)
    python3 -m bench.gpu_bench --device cpu --dtype float32 --tiny     # every part on tiny models, on a CPU

Random weights make acceptance meaningless (the n-gram rows say nothing about real text) but leave the
plain-decoding speed honest: a step's work does not depend on the weights' values. Models stay loaded
from their first part to the last.

Floors. HBM: a decode step reads every weight once (the input embedding only where it is not tied to the
LM head: a step reads just its rows); at --hbm-bytes-per-s (H200: 4.8e12) that caps steps/s, and adding
the KV a step attends to (mean context of the run) a second, lower cap. Compute: 2 x those parameters
FLOPs per token a step computes (attention's own not counted) at --tflops (H200 dense bf16: 989). A
row's % of floor is its steps/s against the lower of the weights + KV and compute caps. Measured figures
include prefill and the host's Python work; the floors count neither.

Warm-ups: each engine run first does its whole timed workload untimed (the same prompts, lengths and
batch; the prefix cache is then cleared, so the timed run computes every prompt): every compile and CUDA
graph capture of the timed run's step shapes happens there. HF warms up on two short generates (its
compile and graph recording; its decode step has one shape). The timed parts count dynamo's new graphs
and (ours) graph captures anyway: compiles_timed / graphs_captured_timed, 0 when the warm-up covered
them. A timed part stops after --config-s seconds; one cut short reports what it produced. A run not
started within --budget-s is listed as skipped. Results print as they come, each part ends with its
table, and the JSON is written after every run to --out, or $OUT/gpu_bench.json when $OUT is set.

Imports only torch, transformers and pipeline.engine / pipeline.loading (which import llguidance, the
grammar layer's library): no omegaconf, Ray or pyarrow.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo.utils as dynamo_utils
from torch.autograd import DeviceType
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, StaticCache

from pipeline.engine import (
    DraftingConfig,
    EngineConfig,
    NgramDrafter,
    SamplingParams,
    SpecEngine,
    TreeParams,
)
from pipeline.engine.backends.cuda.graphs import UNCAPTURED
from pipeline.engine.model.runner import build_runner, cache_kwarg
from pipeline.engine.model.slots import slot_bytes
from pipeline.loading.models import DTYPES, ModelSpec, load_model

H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_TFLOPS = 989.0   # dense bf16, the datasheet's (an 8192^3 bf16 product measured ~790 on one)
TREE_TOKENS = 16           # ngram-tree: a token tree of at most 16 tokens, 4 branches per token, g deep
HF_WARM_TOKENS = 16        # new tokens of each of HF's two warm-up generates
HF_COMPILE_S = 30          # budget seconds HF's part needs left to start on CUDA (its compile)
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def _llama(vocab, hidden, inter, layers, heads, kv_heads, tied, theta=10000.0):
    return lambda: LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               tie_word_embeddings=tied, max_position_embeddings=8192,
                               rope_parameters={"rope_type": "default", "rope_theta": theta})


def _qwen2(vocab, hidden, inter, layers, heads, kv_heads):
    return lambda: Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=True,
                               max_position_embeddings=32768, use_sliding_window=False)


SHAPES = {   # name -> (model class, config); random-init, the real models' shapes, and a tiny one of each family
    "smollm2-135m-shape": (LlamaForCausalLM, _llama(49152, 576, 1536, 30, 9, 3, tied=True)),
    "qwen2.5-1.5b-shape": (Qwen2ForCausalLM, _qwen2(151936, 1536, 8960, 28, 12, 2)),
    "llama-3-8b-shape": (LlamaForCausalLM, _llama(128256, 4096, 14336, 32, 32, 8, tied=False, theta=500000.0)),
    "tiny-smollm2": (LlamaForCausalLM, _llama(512, 64, 128, 2, 4, 2, tied=True)),
    "tiny-qwen2.5": (Qwen2ForCausalLM, _qwen2(512, 64, 128, 2, 4, 2)),
    "tiny": (LlamaForCausalLM, _llama(512, 64, 128, 2, 4, 2, tied=False, theta=500000.0)),   # Llama-3's family
}
REAL_SHAPES = ["smollm2-135m-shape", "qwen2.5-1.5b-shape", "llama-3-8b-shape"]   # the last one is profiled
TINY_SHAPES = ["tiny-smollm2", "tiny-qwen2.5", "tiny"]


def random_model(name: str, dtype: torch.dtype, device: str):
    """A random-init model of a named shape, built on the device in `dtype` (no float32 copy first)."""
    cls, make_config = SHAPES[name]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(make_config())
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval()


def load_dir(path: str, dtype: str, device: str):
    model, _ = load_model(ModelSpec(path, dtype, device))
    return model


def synthetic_prompts(n: int, vocab: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Random token ids (avoiding the lowest 100, where special tokens sit); each prompt repeats one
    of its own 16-token spans once, as grounded prompts quote their input."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(100, vocab) for _ in range(length)]
        at = rng.randrange(0, max(1, length // 2 - 16))
        span = ids[at:at + 16]
        ids[length - len(span):] = span
        prompts.append(ids)
    return prompts


# ---- the floors -----------------------------------------------------------------------------------
def _step_params(model) -> list[torch.Tensor]:
    """The parameters a decode step reads and multiplies by: every one once (parameters() yields a tied
    one once), less the input embedding table when it is not the LM head's matrix (a step reads its rows)."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return [p for p in model.parameters() if p is not embed or embed is head]


def weight_bytes_per_step(model) -> int:
    """Bytes of weights a decode step reads."""
    return sum(p.numel() * p.element_size() for p in _step_params(model))


def matmul_params(model) -> int:
    """Parameters a step multiplies each computed token by (2 FLOPs each)."""
    return sum(p.numel() for p in _step_params(model))


def kv_bytes_per_token(model) -> int:
    """KV bytes one cached position holds over all layers (K and V)."""
    return slot_bytes(model, 1)


def floor(weight_bytes: int, kv_per_token: int, seqs_per_step: float, mean_context: float,
          tokens_per_round: float, bandwidth: float) -> dict:
    """Memory-bound caps: steps/s and tokens/s from weights alone, and from weights + attended KV."""
    steps_w = bandwidth / weight_bytes
    steps_wkv = bandwidth / (weight_bytes + kv_per_token * seqs_per_step * mean_context)
    per_step = seqs_per_step * tokens_per_round
    return {"floor_steps_per_s": steps_w, "floor_tokens_per_s": steps_w * per_step,
            "floor_kv_steps_per_s": steps_wkv, "floor_kv_tokens_per_s": steps_wkv * per_step}


def compute_floor(params: int, tokens_per_step: float, flops_per_s: float, steps_per_s: float,
                  floor_kv_steps_per_s: float) -> dict:
    """The compute cap (2 x params FLOPs per computed token) and the measured steps/s against the lower cap."""
    steps_c = flops_per_s / (2 * params * max(tokens_per_step, 1e-9))
    bound = min(steps_c, floor_kv_steps_per_s)
    return {"floor_compute_steps_per_s": steps_c, "computed_tokens_per_step": tokens_per_step,
            "floor_bound": "compute" if steps_c < floor_kv_steps_per_s else "HBM",
            "pct_of_floor": 100 * steps_per_s / bound}


# ---- one engine configuration ---------------------------------------------------------------------
def build_engine(model, drafter: str, compile: str, graphs: str, batch: int, max_len: int, g: int,
                 run_ahead: str = "auto") -> SpecEngine:
    # the uncaptured dry run needs torch's attention: the graphs replay the model's own forward
    runner = build_runner(model, batch, max_len, compile=compile, cuda_graphs=graphs,
                         cpu_attention="off" if graphs == UNCAPTURED else "auto")
    tree = TreeParams(max_tokens=TREE_TOKENS, max_branches=4) if drafter == "ngram-tree" else TreeParams()
    ngram = NgramDrafter(2, 4, device=runner.device, tree=tree) if drafter.startswith("ngram") else None
    if graphs == UNCAPTURED and run_ahead == "auto":    # the dry run takes the path a GPU's auto takes
        run_ahead = "on"
    cfg = EngineConfig(max_num_seqs=batch, max_model_len=max_len, max_prefill_tokens=4096, compile=compile,
                       cuda_graphs="off" if graphs == UNCAPTURED else graphs,   # not a config value
                       run_ahead=run_ahead)
    # adaptive: the cost curves, measured at the first step (a warm-up's); drafter none drafts nothing to size
    return SpecEngine(runner, ngram, cfg, eos_token_ids=[],
                      drafting=DraftingConfig(num_speculative_tokens=g, tree=tree, adaptive=drafter != "none"))


def drive(engine: SpecEngine, prompts, params: SamplingParams, prefix: str, deadline: float) -> dict:
    """Queue every prompt, step until done or past the deadline; counts from the round records."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params, seed=i)
    counts = {"steps": 0, "rounds": 0, "emitted": 0, "drafted": 0, "accepted": 0, "finished": 0}
    while engine.has_unfinished() and time.perf_counter() < deadline:
        out = engine.step()
        counts["steps"] += bool(out.rounds)
        counts["rounds"] += len(out.rounds)
        counts["finished"] += len(out.finished)
        for r in out.rounds:
            counts["emitted"] += r.emitted
            counts["drafted"] += r.draft_len
            counts["accepted"] += r.accepted
    engine.target.synchronize()
    return counts


def graph_stats(graphs) -> dict:
    """The target runner's CUDA graphs so far (all zero where it has none)."""
    if graphs is None:
        return {"graphs_captured": 0, "graph_steps": 0, "graph_verify_steps": 0, "graph_capture_s": 0.0,
                "graphs_off_because": None, "graph_verify_off_because": None}
    return {"graphs_captured": graphs.num_graphs, "graph_steps": graphs.num_replays,
            "graph_verify_steps": graphs.num_tails, "graph_capture_s": graphs.capture_s,
            "graphs_off_because": graphs.disabled_reason, "graph_verify_off_because": graphs.tails_disabled_reason}


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return dynamo_utils.counters["stats"]["unique_graphs"]


def _warm_up(engine: SpecEngine, prompts, batch: int, params: SamplingParams, full: bool) -> None:
    if full:   # the timed workload itself, then no prefix of it left to reuse
        drive(engine, prompts, params, "warm", float("inf"))
        engine.reset_prefix_cache()
    else:      # the timed prompts reversed (the same lengths, no prefix to reuse), 8 tokens each
        warm = [p[::-1] for p in prompts[:max(2, batch)]]
        drive(engine, warm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), "warm", float("inf"))


def run_config(model, drafter: str, compile: str, graphs: str, batch: int, prompts, args, seconds: float,
               weight_bytes: int, full_warmup: bool = False, run_ahead: str = "auto") -> dict:
    """One timed run of `prompts` (at most `batch` at once) after its warm-up: the whole workload with
    full_warmup, else 8 tokens of as many prompts as run at once (the compiles; the graphs of buckets
    first met in the timed run are captured inside it, and tokens/s is also given without those seconds)."""
    max_len = max(len(p) for p in prompts) + args.max_tokens + 8
    engine = build_engine(model, drafter, compile, graphs, batch, max_len, args.g, run_ahead)
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    _warm_up(engine, prompts, batch, params, full_warmup)
    warm_s = time.perf_counter() - t0
    before, compiled_before = graph_stats(engine.target.graphs), dynamo_graphs()
    ahead_before = engine.num_steps_ahead
    t0 = time.perf_counter()
    c = drive(engine, prompts, params, "p", t0 + seconds)
    wall = time.perf_counter() - t0
    stats = graph_stats(engine.target.graphs)
    timed_capture_s = stats["graph_capture_s"] - before["graph_capture_s"]
    res = {"drafter": drafter, "compile": compile, "attention": "flex" if engine.target.flex else "sdpa",
           "compiled_layers": engine.target.compiled_layers, "layers_off_because": engine.target.layers_off_reason,
           "cuda_graphs": graphs, **stats, "timed_capture_s": timed_capture_s,
           "run_ahead": engine.run_ahead, "steps_ahead": engine.num_steps_ahead - ahead_before,
           "graphs_captured_timed": stats["graphs_captured"] - before["graphs_captured"],
           "compiles_timed": dynamo_graphs() - compiled_before, "full_warmup": full_warmup,
           "tokens_per_s_without_capture": c["emitted"] / max(wall - timed_capture_s, 1e-9),
           "batch": batch, "warmup_s": warm_s, "wall_s": wall, "timed_out": c["finished"] < len(prompts),
           "num_prompts": len(prompts), **c, "tokens_per_s": c["emitted"] / wall, "steps_per_s": c["steps"] / wall,
           "seqs_per_step": c["rounds"] / max(c["steps"], 1),
           "tokens_per_round": c["emitted"] / max(c["rounds"], 1),
           "acceptance_rate": c["accepted"] / c["drafted"] if c["drafted"] else None}
    if model.device.type == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated(model.device) / 2**30
    mean_context = sum(map(len, prompts)) / len(prompts) + args.max_tokens / 2
    res.update(floor(weight_bytes, kv_bytes_per_token(model), res["seqs_per_step"], mean_context,
                     res["tokens_per_round"], args.hbm_bytes_per_s))
    tflops = getattr(args, "tflops", H200_BF16_TFLOPS)     # bench.research.gpu_profile's args carry none
    params = weight_bytes // model.dtype.itemsize         # the runner may have swapped the model's linears
    res.update(compute_floor(params, (c["rounds"] + c["drafted"]) / max(c["steps"], 1),
                             tflops * 1e12, res["steps_per_s"], res["floor_kv_steps_per_s"]))
    del engine
    _release(model)
    return res


def _release(model) -> None:
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def describe(name: str, r: dict) -> str:
    acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
    cut = f" (cut at {r['wall_s']:.0f} s: {r['finished']}/{r['num_prompts']} done)" if r["timed_out"] else ""
    graphs = (f" graphs={r['cuda_graphs']}({r['graphs_captured']} captured in {r['graph_capture_s']:.1f} s, "
              f"{r['timed_capture_s']:.1f} s of it timed: {r['tokens_per_s_without_capture']:.1f} tok/s without, "
              f"{r['graph_steps']} steps, {r['graph_verify_steps']} verifying inside"
              + (f"; OFF: {r['graphs_off_because']}" if r["graphs_off_because"] else "")
              + (f"; verification after the graph: {r['graph_verify_off_because']}"
                 if r["graph_verify_off_because"] else "") + ")")
    timed = f", {r['compiles_timed']} compiles timed" if r.get("compiles_timed") else ""
    layers = (f", {r['compiled_layers']} layers compiled" if r["compiled_layers"] else "") + (
        f", layers not compiled: {r['layers_off_because']}" if r["layers_off_because"] else "")
    ahead = f", {r['steps_ahead']} steps run ahead" if r.get("run_ahead") else ", run-ahead off"
    return (f"{name}{graphs} compile={r['compile']}({r['attention']}{layers}{ahead}) batch={r['batch']} "
            f"drafter={r['drafter']}: "
            f"{r['tokens_per_s']:8.1f} tok/s, {r['steps_per_s']:6.1f} steps/s, {r['seqs_per_step']:.1f} seqs/step, "
            f"{r['tokens_per_round']:.2f} tok/round, acceptance {acc}, warm-up {r['warmup_s']:.1f} s{timed}{cut}\n"
            f"    HBM floor: {r['floor_steps_per_s']:8.0f} steps/s -> {r['floor_tokens_per_s']:9.0f} tok/s (weights), "
            f"{r['floor_kv_tokens_per_s']:9.0f} tok/s (weights + KV); compute floor "
            f"{r['floor_compute_steps_per_s']:8.0f} steps/s; measured = {r['pct_of_floor']:.3g}% of the lower "
            f"({r['floor_bound']})")


# ---- Hugging Face generate, batch 1 ---------------------------------------------------------------
def hf_generate(model, prompts, max_tokens: int, seconds: float) -> dict:
    """HF `generate` at batch 1 on `prompts` in order, greedy, max_tokens new tokens each (min_new_tokens:
    EOS never stops a row), until done or `seconds` pass, after two short warm-up generates. One
    StaticCache, reset between prompts, serves every call: transformers compiles the decode step (on CUDA;
    torch.compile, mode reduce-overhead) when the cache is static, and a cache that keeps its addresses
    keeps the recorded CUDA graphs valid."""
    model.set_attn_implementation("sdpa")      # transformers' own attention (a runner may have routed it)
    cache = StaticCache(config=model.config, max_cache_len=max(map(len, prompts)) + max_tokens + 1)
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos if isinstance(eos, int) else (eos or [0])[0])

    def run(batch, n: int, deadline: float) -> tuple[int, int]:
        done = emitted = 0
        for p in batch:
            if time.perf_counter() >= deadline:
                break
            cache.reset()
            ids = torch.tensor([p], device=model.device)                                  # [1, prompt]
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=pad,
                                 **{cache_kwarg(model): cache})                            # [1, prompt + n]
            done, emitted = done + 1, emitted + out.shape[1] - len(p)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        return done, emitted

    compiled_before, t0 = dynamo_graphs(), time.perf_counter()
    run(prompts[:2], HF_WARM_TOKENS, float("inf"))
    warm_s, compiled_warm = time.perf_counter() - t0, dynamo_graphs() - compiled_before
    compiled_before, t0 = dynamo_graphs(), time.perf_counter()
    done, emitted = run(prompts, max_tokens, t0 + seconds)
    wall = time.perf_counter() - t0
    return {"engine": "hf-generate", "cache": "static", "batch": 1, "compiled": compiled_warm > 0,
            "warmup_s": warm_s, "compiles_timed": dynamo_graphs() - compiled_before, "wall_s": wall,
            "num_prompts": len(prompts), "finished": done, "timed_out": done < len(prompts), "emitted": emitted,
            "tokens_per_s": emitted / wall}


def describe_hf(name: str, r: dict) -> str:
    cut = f" (cut at {r['wall_s']:.0f} s: {r['finished']}/{r['num_prompts']} done)" if r["timed_out"] else ""
    return (f"{name} HF generate (static cache, {'compiled' if r['compiled'] else 'eager'}) batch=1: "
            f"{r['tokens_per_s']:8.1f} tok/s, warm-up {r['warmup_s']:.1f} s, {r['compiles_timed']} compiles timed{cut}")


# ---- the profiler ---------------------------------------------------------------------------------
def profile_config(model, compile: str, graphs: str, batch: int, prompts, args) -> dict:
    """torch.profiler over args.profile_steps decode steps of `batch` prompts at once (drafter none), after
    a warm-up on the same workload and once every prompt is admitted and prefilled."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities):    # the tracer's start-up, before any graph capture
        torch.zeros(1, device=model.device).add_(1)
    max_len = max(len(p) for p in prompts) + args.max_tokens + 8
    engine = build_engine(model, "none", compile, graphs, batch, max_len, args.g)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    _warm_up(engine, prompts, batch, params, full=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params, seed=i)
    while engine.num_waiting or engine.scheduler.prefilling:
        engine.step()
    engine.step()
    engine.target.synchronize()
    steps = min(args.profile_steps, args.max_tokens // 2)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        engine.target.synchronize()
        wall = time.perf_counter() - t0
    return {"compile": compile, "cuda_graphs": graphs, "batch": batch, **profile_summary(prof, steps, wall)}


def _top(totals: dict[str, list[float]], top: int = 10) -> list[dict]:
    """name -> [total us, count], the `top` largest as rows with their share of the sum."""
    whole = sum(t for t, _ in totals.values()) or 1.0
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": n, "total_ms": t / 1e3, "count": int(c), "share": t / whole} for n, (t, c) in rows]


def _busy_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def profile_summary(prof, steps: int, wall_s: float) -> dict:
    """Per step: device kernels and copies, the host's launch calls (graph launches among them), the
    device's busy and idle time between its first and last kernel, the top kernels by device time. With
    no device events (a CPU run): the ops per step and the top ops by self CPU time."""
    events = prof.events()
    base = {"steps": steps, "wall_ms_per_step": 1e3 * wall_s / steps}
    device = [e for e in events if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
              and not e.name.endswith("Sync")]
    if not device:
        ops: dict[str, list[float]] = {}
        for a in prof.key_averages():
            ops[a.key] = [a.self_cpu_time_total, a.count]
        return {**base, "device": "cpu", "ops_per_step": sum(c for _, c in ops.values()) / steps, "top": _top(ops)}
    copies = [e for e in device if e.name.startswith(("Memcpy", "Memset"))]
    kernels: dict[str, list[float]] = {}
    for e in device:
        if not e.name.startswith(("Memcpy", "Memset")):
            row = kernels.setdefault(e.name, [0.0, 0])
            row[0] += e.time_range.end - e.time_range.start
            row[1] += 1
    spans = [(e.time_range.start, e.time_range.end) for e in device]
    launches = [e.name for e in events if e.device_type == DeviceType.CPU and e.name in LAUNCH_CALLS]
    busy = _busy_us(spans)
    span = max(end for _, end in spans) - min(start for start, _ in spans)
    return {**base, "device": "cuda", "kernels_per_step": sum(c for _, c in kernels.values()) / steps,
            "copies_per_step": len(copies) / steps, "launch_calls_per_step": len(launches) / steps,
            "graph_launches_per_step": launches.count("cudaGraphLaunch") / steps,
            "device_busy_ms_per_step": busy / 1e3 / steps, "device_idle_ms_per_step": (span - busy) / 1e3 / steps,
            "top": _top(kernels)}


def describe_profile(name: str, r: dict) -> str:
    head = (f"profile {name} batch={r['batch']} compile={r['compile']} graphs={r['cuda_graphs']}, {r['steps']} "
            f"decode steps: {r['wall_ms_per_step']:.2f} ms/step wall under the profiler\n")
    if r["device"] == "cpu":
        head += f"    {r['ops_per_step']:.0f} CPU ops/step (nested included)\n    self ms  share   count  op\n"
    else:
        head += (f"    {r['kernels_per_step']:.1f} kernels/step, {r['copies_per_step']:.1f} copies/step; "
                 f"{r['launch_calls_per_step']:.1f} launch calls/step ({r['graph_launches_per_step']:.1f} of them "
                 f"graph launches); device busy {r['device_busy_ms_per_step']:.3f} ms/step, idle "
                 f"{r['device_idle_ms_per_step']:.3f} ms/step\n    total ms  share  count  kernel\n")
    return head + "\n".join(f"    {t['total_ms']:8.3f} {100 * t['share']:5.1f}% {t['count']:6d}  {t['name'][:90]}"
                            for t in r["top"])


# ---- the whole check ------------------------------------------------------------------------------
@dataclass
class Loaded:
    """A model kept from its first part to the last, with its report entry and prompts."""
    name: str
    model: object
    entry: dict
    prompts: list[list[int]]
    weight_bytes: int


@dataclass
class Task:
    """One run of the check: a part's engine configuration, HF baseline or profile on one model."""
    part: str
    model: str
    what: str
    need_s: float                                   # budget seconds left that it needs to start
    run: Callable[[Loaded, float], dict]            # (model, timed seconds) -> result
    kind: str = "configs"                           # where the result goes in the model's entry


def headline(args) -> tuple[str, str]:
    """(compile, cuda_graphs) of parts 1-3: compile on where listed, the first graphs mode (on, on CUDA)."""
    return ("on" if "on" in args.compile.split(",") else "off"), args.cuda_graphs.split(",")[0]


def configurations(args, num_prompts: int) -> list[tuple[str, str, int, str]]:
    """(compile, cuda_graphs, batch, drafter), most telling first: compile and graphs modes as listed
    (compile outermost: with --compile off,on the compiled ones are what a spent budget skips), every
    prompt at once, then batch 1."""
    return [(mode, graphs, batch, drafter) for mode in args.compile.split(",") for graphs in args.cuda_graphs.split(",")
            for batch in (num_prompts, 1) for drafter in args.drafters.split(",")]


def _engine(args, part: str, drafter: str, compile: str, graphs: str, batch: int, run_ahead: str = "auto"):
    def run(m: Loaded, seconds: float) -> dict:
        prompts = m.prompts[:args.b1_prompts] if batch == 1 else m.prompts[:batch]
        res = run_config(m.model, drafter, compile, graphs, batch, prompts, args, seconds, m.weight_bytes,
                         full_warmup=True, run_ahead=run_ahead)
        return {"part": part, **res}
    return run


def tasks(args, names: list[str]) -> list[Task]:
    """Every run of the check, in order: parts 1-4 (the module's docstring)."""
    compile, graphs = headline(args)
    plain = f"drafter=none compile={compile} graphs={graphs}"
    hf_need = HF_COMPILE_S if args.device.startswith("cuda") else 5
    out = []
    for n in names:
        out.append(Task("1 batch 1 vs HF", n, "HF generate batch=1", hf_need, kind="hf",
                        run=lambda m, s: hf_generate(m.model, m.prompts[:args.b1_prompts], args.max_tokens, s)))
        out.append(Task("1 batch 1 vs HF", n, f"{plain} batch=1", 5, _engine(args, "b1", "none", compile, graphs, 1)))
        out.append(Task("1 batch 1 vs HF", n, f"{plain} run_ahead=off batch=1", 5,
                        _engine(args, "b1-waits", "none", compile, graphs, 1, run_ahead="off")))
    for n in names:
        out += [Task("2 at once", n, f"{plain} batch={b}", 5, _engine(args, "at-once", "none", compile, graphs, b))
                for b in args.at_once]
    out += [Task("3 profile", names[-1], f"profile batch={b}", 5, kind="profiles",
                 run=lambda m, s, b=b: profile_config(m.model, compile, graphs, b, m.prompts[:b], args))
            for b in args.profile_batches]
    seen = {(compile, graphs, b, "none") for b in [1, *args.at_once]}
    for n in (names[:1] if args.tiny else names):
        out += [Task("4 the rest", n, f"drafter={d} compile={c} graphs={g} batch={b}", 5,
                     _engine(args, "rest", d, c, g, b))
                for c, g, b, d in configurations(args, args.num_prompts) if (c, g, b, d) not in seen]
    return out


def models_to_run(args) -> list[tuple[str, str, Callable]]:
    """(name, kind, loader): model directories if given, else the random-init shapes."""
    if args.model_dir:
        found = [d for d in args.model_dir if Path(d).is_dir()]
        for d in sorted(set(args.model_dir) - set(found)):
            print(f"model dir {d}: not found, skipped (the real-model figures need it carried along)", flush=True)
        return [(Path(d).name, "checkpoint", lambda d=d: load_dir(d, args.dtype, args.device)) for d in found]
    dtype = DTYPES[args.dtype]
    return [(n, "random-init", lambda n=n: random_model(n, dtype, args.device))
            for n in (TINY_SHAPES if args.tiny else REAL_SHAPES)]


def load(name: str, kind: str, loader: Callable, args, report: dict) -> Loaded:
    t0 = time.perf_counter()
    model = loader()
    weight_bytes = weight_bytes_per_step(model)
    prompts = synthetic_prompts(max(args.num_prompts, *args.at_once, *args.profile_batches, args.b1_prompts),
                                model.config.vocab_size, args.min_prompt, args.max_prompt)
    entry = {"model": name, "kind": kind, "weight_bytes_per_step": weight_bytes, "matmul_params": matmul_params(model),
             "load_s": time.perf_counter() - t0, "configs": [], "hf": [], "profiles": []}
    report["models"].append(entry)
    print(f"== {name} ({kind}{', acceptance meaningless' if kind == 'random-init' else ''}): "
          f"{weight_bytes / 1e6:.1f} MB of weights per step, {entry['matmul_params'] / 1e6:.1f} M parameters "
          f"multiplied per token, made in {entry['load_s']:.1f} s; prompts of {args.min_prompt}-{args.max_prompt} "
          f"tokens, {args.max_tokens} new tokens each", flush=True)
    return Loaded(name, model, entry, prompts, weight_bytes)


def run_task(task: Task, m: Loaded, seconds: float) -> None:
    try:
        res = task.run(m, seconds)
    except Exception as exc:            # report and go on: one failing path must not hide the others
        res = {"what": task.what, "error": f"{type(exc).__name__}: {exc}"}
        print(f"{m.name} {task.what}: FAILED {res['error']}", flush=True)
    else:
        show = {"hf": describe_hf, "profiles": describe_profile}.get(task.kind, describe)
        print(show(m.name, res), flush=True)
    m.entry[task.kind].append(res)
    _release(m.model)                   # here, where a failed run's traceback no longer holds its engine


# ---- the tables each part ends with ---------------------------------------------------------------
def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "error" not in r]


def table_b1(report: dict, args) -> str:
    lines = [(f"batch 1, ours against HF generate (static cache), {args.b1_prompts} prompts x {args.max_tokens} "
              f"new tokens (waits: ours with run_ahead off):"),
             f"  {'model':20} {'ours tok/s':>10} {'waits':>7} {'HF tok/s':>9} {'ours/HF':>8} {'% floor':>8}  HF"]
    report["b1_vs_hf"] = []
    for e in report["models"]:
        ours = [r for r in _ok(e["configs"]) if r["part"] == "b1"]
        waits = [r["tokens_per_s"] for r in _ok(e["configs"]) if r["part"] == "b1-waits"]
        hf = _ok(e["hf"])
        if not ours or not hf:
            continue
        o, h = ours[0], hf[0]
        ratio = o["tokens_per_s"] / max(h["tokens_per_s"], 1e-9)
        report["b1_vs_hf"].append({"model": e["model"], "ours_tokens_per_s": o["tokens_per_s"],
                                   "ours_waiting_tokens_per_s": waits[0] if waits else None,
                                   "hf_tokens_per_s": h["tokens_per_s"], "ratio": ratio})
        lines.append(f"  {e['model']:20} {o['tokens_per_s']:10.1f} {f'{waits[0]:.1f}' if waits else '-':>7} "
                     f"{h['tokens_per_s']:9.1f} {ratio:8.2f} {o['pct_of_floor']:7.1f}%  "
                     f"{'compiled' if h['compiled'] else 'eager'}, warm-up {h['warmup_s']:.0f} s")
    return "\n".join(lines)


def table_at_once(report: dict, args) -> str:
    compile, graphs = headline(args)
    lines = [f"plain decoding, drafter none, compile {compile}, graphs {graphs}:",
             (f"  {'model':20} {'batch':>5} {'tok/s':>9} {'steps/s':>8} {'HBM floor':>10} {'compute':>10} "
              f"{'% floor':>8}  (floors in steps/s: weights + KV, 2 x params x tokens)")]
    for e in report["models"]:
        for r in _ok(e["configs"]):
            if r["part"] in ("b1", "at-once"):
                lines.append(f"  {e['model']:20} {r['batch']:5d} {r['tokens_per_s']:9.1f} {r['steps_per_s']:8.1f} "
                             f"{r['floor_kv_steps_per_s']:10.0f} {r['floor_compute_steps_per_s']:10.0f} "
                             f"{r['pct_of_floor']:7.1f}%  {r['floor_bound']}"
                             + (" (cut)" if r["timed_out"] else ""))
    return "\n".join(lines)


TABLES = {"1 batch 1 vs HF": table_b1, "2 at once": table_at_once}


def write_report(report: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(report, indent=1))


def environment(args) -> dict:
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device,
           "dtype": args.dtype, "hbm_bytes_per_s": args.hbm_bytes_per_s, "tflops": args.tflops}
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return env


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", nargs="*", default=[], help="HF safetensors directories (else random-init)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model of each family, short prompts (part 4 on the first model only): a dry run "
                         "of every part")
    ap.add_argument("--compile", default="off,on", help="engine.compile modes of part 4, comma-separated "
                                                        "(parts 1-3: on if listed)")
    ap.add_argument("--cuda-graphs", default=None,
                    help="engine.cuda_graphs modes of part 4, comma-separated; parts 1-3 run the first (default: "
                         "on,off on CUDA, uncaptured,off elsewhere; 'uncaptured': the graphs' padded forward "
                         "without capture, so that a CPU dry run takes the path a GPU does)")
    ap.add_argument("--drafters", default="none,ngram,ngram-tree",
                    help="part 4: none | ngram (a single path) | ngram-tree (a token tree of 16 tokens)")
    ap.add_argument("--b1-prompts", type=int, default=4, help="prompts of the batch-1 runs (ours and HF)")
    ap.add_argument("--at-once", type=_ints, default=[64, 256], help="part 2's batches, comma-separated")
    ap.add_argument("--profile-batches", type=_ints, default=[1, 64], help="part 3's batches, comma-separated")
    ap.add_argument("--profile-steps", type=int, default=10, help="decode steps under the profiler")
    ap.add_argument("--num-prompts", type=int, default=64, help="part 4's prompts at once")
    ap.add_argument("--min-prompt", type=int, default=100)
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--g", type=int, default=4, help="draft tokens per round")
    ap.add_argument("--config-s", type=float, default=6.0, help="timed seconds per run, at most")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no run starts after this")
    ap.add_argument("--hbm-bytes-per-s", type=float, default=H200_HBM_BYTES_PER_S)
    ap.add_argument("--tflops", type=float, default=H200_BF16_TFLOPS,
                    help="dense matrix TFLOP/s of the card in --dtype (H200 bf16: 989)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_bench.json when $OUT is set)")
    args = ap.parse_args(argv)
    if args.cuda_graphs is None:
        args.cuda_graphs = "on,off" if args.device.startswith("cuda") else f"{UNCAPTURED},off"
    if args.tiny:
        args.num_prompts, args.min_prompt, args.max_prompt, args.max_tokens = 6, 20, 40, 16
        args.b1_prompts, args.at_once, args.profile_batches, args.profile_steps = 2, [64, 256], [1, 64], 4
    if args.out is None and os.environ.get("OUT"):
        args.out = str(Path(os.environ["OUT"]) / "gpu_bench.json")
    return args


def run_all(todo: list[Task], loaders: dict, args, report: dict, t_start: float) -> None:
    """Each task in order while the budget lasts; a model is made at its first task and kept."""
    loaded: dict[str, Loaded | str] = {}          # name -> the model, or why it could not be made
    for i, task in enumerate(todo):
        left = args.budget_s - (time.monotonic() - t_start)
        if left < task.need_s or isinstance(loaded.get(task.model), str):
            why = "budget spent" if left < task.need_s else loaded[task.model]
            report["skipped"].append({"part": task.part, "model": task.model, "what": task.what, "why": why})
            print(f"{task.model} {task.what}: skipped ({why})", flush=True)
        else:
            if task.model not in loaded:
                try:
                    loaded[task.model] = load(task.model, *loaders[task.model], args, report)
                except Exception as exc:     # the other models' figures still come
                    loaded[task.model] = f"not made: {type(exc).__name__}: {exc}"
                    print(f"== {task.model}: {loaded[task.model]}", flush=True)
            if isinstance(loaded[task.model], Loaded):
                run_task(task, loaded[task.model], min(args.config_s, left))
        write_report(report, args.out)
        if task.part in TABLES and (i + 1 == len(todo) or todo[i + 1].part != task.part):
            print(TABLES[task.part](report, args), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    report = {"environment": environment(args), "models": [], "skipped": []}
    print(f"gpu_bench: {report['environment']}", flush=True)
    if not args.model_dir:
        print("no --model-dir: random-init models of the real shapes; plain-decoding speed is honest, "
              "n-gram acceptance is meaningless", flush=True)
    loaders = {name: (kind, loader) for name, kind, loader in models_to_run(args)}
    run_all(tasks(args, list(loaders)) if loaders else [], loaders, args, report, t_start)
    write_report(report, args.out)
    print(f"gpu_bench: done in {time.monotonic() - t_start:.0f} s" + (f", JSON in {args.out}" if args.out else ""),
          flush=True)


if __name__ == "__main__":
    main()
