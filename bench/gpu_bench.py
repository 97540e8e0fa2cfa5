"""GPU throughput check: the engine on one device, plain decoding (drafter none), n-gram drafting of a
single path and of a token tree (ngram-tree: 16 tokens verified per row, what a tree step costs),
steps replayed as CUDA graphs and launched from Python (cuda_graphs on / off), eager attention
(compile off) and compiled FlexAttention (compile on), one sequence at a time (batch 1) and every
prompt at once, each figure printed next to its HBM floor.

    python3 -m bench.gpu_bench                              # random-init SmolLM2-135M and Qwen2.5-1.5B shapes
    python3 -m bench.gpu_bench --model-dir DIR [DIR ...]    # real checkpoints (HF safetensors directories)
    python3 -m bench.gpu_bench --device cpu --dtype float32 --tiny     # dry run of this script on a CPU

Random weights make acceptance meaningless (the n-gram rows say nothing about real text) but leave the
plain-decoding speed honest: a step's work does not depend on the weights' values.

HBM floor: a decode step reads every weight once (the input embedding only where it is not tied to
the LM head: a step reads just its rows). At --hbm-bytes-per-s (H200: 4.8e12) that caps steps/s at
bandwidth / weight bytes, and tokens/s at that times the sequences per step times the measured
tokens per sequence-round. A second cap adds the KV bytes a step attends to (mean context of the
run). Measured figures include prefill and the host's Python work; the floors count neither.

Each configuration warms up outside the clock on as many prompts as it runs at once (two at batch 1),
8 tokens each: the compiles of every step size the timed run meets first (prefill, the widest steps,
which with CUDA graphs on are those too large for a graph and run eagerly) happen there. Then it
runs for at most --config-s seconds; a configuration cut short reports what it produced. A
configuration not started within --budget-s is listed as skipped. Results print as they come and are
written after every configuration to --out, or $OUT/gpu_bench.json when $OUT is set.

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
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pipeline.engine import (
    DraftingConfig,
    EngineConfig,
    NgramDrafter,
    SamplingParams,
    SpecEngine,
    TreeParams,
)
from pipeline.engine.backends.cuda.graphs import UNCAPTURED
from pipeline.engine.model.runner import build_runner
from pipeline.engine.model.slots import slot_bytes
from pipeline.loading.models import DTYPES, ModelSpec, load_model

H200_HBM_BYTES_PER_S = 4.8e12
TREE_TOKENS = 16         # ngram-tree: a token tree of at most 16 tokens, 4 branches per token, g deep
SHAPES = {   # name -> (model class, config); random-init, the real models' shapes
    "smollm2-135m-shape": (LlamaForCausalLM, lambda: LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=8192)),
    "qwen2.5-1.5b-shape": (Qwen2ForCausalLM, lambda: Qwen2Config(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768, use_sliding_window=False)),
    "tiny": (LlamaForCausalLM, lambda: LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=1024)),
}


def random_model(name: str, dtype: torch.dtype, device: str):
    """A random-init model of a named shape, built directly on the device."""
    cls, make_config = SHAPES[name]
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(make_config())
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


# ---- the floor ------------------------------------------------------------------------------------
def weight_bytes_per_step(model) -> int:
    """Bytes of weights a decode step reads: every parameter once (shared ones once), less the input
    embedding table when it is not the LM head's matrix (a step reads only its rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())     # parameters() yields a tied one once
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed is not head:
        total -= embed.numel() * embed.element_size()
    return total


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


# ---- one configuration ----------------------------------------------------------------------------
def build_engine(model, drafter: str, compile: str, graphs: str, batch: int, max_len: int, g: int) -> SpecEngine:
    # the uncaptured dry run needs torch's attention: the graphs replay the model's own forward
    runner = build_runner(model, batch, max_len, compile=compile, cuda_graphs=graphs,
                         cpu_attention="off" if graphs == UNCAPTURED else "auto")
    tree = TreeParams(max_tokens=TREE_TOKENS, max_branches=4) if drafter == "ngram-tree" else TreeParams()
    ngram = NgramDrafter(2, 4, device=runner.device, tree=tree) if drafter.startswith("ngram") else None
    cfg = EngineConfig(max_num_seqs=batch, max_model_len=max_len, max_prefill_tokens=4096, compile=compile,
                       cuda_graphs="off" if graphs == UNCAPTURED else graphs)   # not a config value
    return SpecEngine(runner, ngram, cfg, eos_token_ids=[],
                      drafting=DraftingConfig(num_speculative_tokens=g, tree=tree))


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
        return {"graphs_captured": 0, "graph_steps": 0, "graph_capture_s": 0.0, "graphs_off_because": None}
    return {"graphs_captured": graphs.num_graphs, "graph_steps": graphs.num_replays,
            "graph_capture_s": graphs.capture_s, "graphs_off_because": graphs.disabled_reason}


def run_config(model, drafter: str, compile: str, graphs: str, batch: int, prompts, args, seconds: float,
               weight_bytes: int) -> dict:
    max_len = max(len(p) for p in prompts) + args.max_tokens + 8
    engine = build_engine(model, drafter, compile, graphs, batch, max_len, args.g)
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    t0 = time.perf_counter()
    # the warm-up's prompts are the timed ones reversed: the same lengths, no prefix to reuse
    warm = [p[::-1] for p in prompts[:max(2, batch)]]
    drive(engine, warm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), "warm", float("inf"))
    warm_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    capture_before = graph_stats(engine.target.graphs)["graph_capture_s"]
    t0 = time.perf_counter()
    c = drive(engine, prompts, params, "p", t0 + seconds)
    wall = time.perf_counter() - t0
    stats = graph_stats(engine.target.graphs)
    # graphs of buckets first met in the timed run are captured inside it (the warm-up's steps meet
    # few: its rows all end together): tokens/s is given with and without those seconds
    timed_capture_s = stats["graph_capture_s"] - capture_before
    res = {"drafter": drafter, "compile": compile, "attention": "flex" if engine.target.flex else "sdpa",
           "cuda_graphs": graphs, **stats, "timed_capture_s": timed_capture_s,
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
    del engine
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def describe(name: str, r: dict) -> str:
    acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
    cut = f" (cut at {r['wall_s']:.0f} s: {r['finished']}/{r['num_prompts']} done)" if r["timed_out"] else ""
    graphs = (f" graphs={r['cuda_graphs']}({r['graphs_captured']} captured in {r['graph_capture_s']:.1f} s, "
              f"{r['timed_capture_s']:.1f} s of it timed: {r['tokens_per_s_without_capture']:.1f} tok/s without, "
              f"{r['graph_steps']} steps"
              + (f"; OFF: {r['graphs_off_because']}" if r["graphs_off_because"] else "") + ")")
    return (f"{name}{graphs} compile={r['compile']}({r['attention']}) batch={r['batch']} drafter={r['drafter']}: "
            f"{r['tokens_per_s']:8.1f} tok/s, {r['steps_per_s']:6.1f} steps/s, {r['seqs_per_step']:.1f} seqs/step, "
            f"{r['tokens_per_round']:.2f} tok/round, acceptance {acc}, warm-up {r['warmup_s']:.1f} s{cut}\n"
            f"    HBM floor: {r['floor_steps_per_s']:8.0f} steps/s -> {r['floor_tokens_per_s']:9.0f} tok/s (weights), "
            f"{r['floor_kv_tokens_per_s']:9.0f} tok/s (weights + KV); measured = "
            f"{100 * r['tokens_per_s'] / r['floor_tokens_per_s']:.3g}% of the weights floor")


# ---- the whole check ------------------------------------------------------------------------------
def configurations(args, num_prompts: int) -> list[tuple[str, str, int, str]]:
    """(compile, cuda_graphs, batch, drafter), most telling first: compile and graphs modes as listed
    (compile outermost: with --compile off,on the compiled ones are what a spent budget skips), every
    prompt at once, then batch 1."""
    return [(mode, graphs, batch, drafter) for mode in args.compile.split(",") for graphs in args.cuda_graphs.split(",")
            for batch in (num_prompts, 1) for drafter in args.drafters.split(",")]


def models_to_run(args) -> list[tuple[str, str, callable]]:
    """(name, kind, loader): model directories if given, else the random-init shapes."""
    if args.model_dir:
        found = [d for d in args.model_dir if Path(d).is_dir()]
        for d in sorted(set(args.model_dir) - set(found)):
            print(f"model dir {d}: not found, skipped (the real-model figures need it carried along)", flush=True)
        return [(Path(d).name, "checkpoint", lambda d=d: load_dir(d, args.dtype, args.device)) for d in found]
    names = ["tiny"] if args.tiny else ["smollm2-135m-shape", "qwen2.5-1.5b-shape"]
    dtype = DTYPES[args.dtype]
    return [(n, "random-init", lambda n=n: random_model(n, dtype, args.device)) for n in names]


def bench_model(name: str, kind: str, model, args, report: dict, t_start: float) -> None:
    weight_bytes = weight_bytes_per_step(model)
    prompts = synthetic_prompts(args.num_prompts, model.config.vocab_size, args.min_prompt, args.max_prompt)
    entry = {"model": name, "kind": kind, "weight_bytes_per_step": weight_bytes, "configs": [], "skipped": []}
    report["models"].append(entry)
    print(f"== {name} ({kind}{', acceptance meaningless' if kind == 'random-init' else ''}): "
          f"{weight_bytes / 1e6:.1f} MB of weights per step, {len(prompts)} prompts of "
          f"{args.min_prompt}-{args.max_prompt} tokens, {args.max_tokens} new tokens each", flush=True)
    for compile, graphs, batch, drafter in configurations(args, len(prompts)):
        left = args.budget_s - (time.monotonic() - t_start)
        what = f"{name} graphs={graphs} compile={compile} batch={batch} drafter={drafter}"
        if left < 5:
            entry["skipped"].append({"compile": compile, "cuda_graphs": graphs, "batch": batch, "drafter": drafter})
            print(f"{what}: skipped (budget spent)", flush=True)
            continue
        try:
            res = run_config(model, drafter, compile, graphs, batch, prompts, args, min(args.config_s, left),
                             weight_bytes)
        except Exception as exc:            # report and go on: one failing path must not hide the others
            res = {"compile": compile, "cuda_graphs": graphs, "batch": batch, "drafter": drafter,
                   "error": f"{type(exc).__name__}: {exc}"}
            print(f"{what}: FAILED {res['error']}", flush=True)
        else:
            print(describe(name, res), flush=True)
        entry["configs"].append(res)
        write_report(report, args.out)


def write_report(report: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(report, indent=1))


def environment(args) -> dict:
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device,
           "dtype": args.dtype, "hbm_bytes_per_s": args.hbm_bytes_per_s}
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return env


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", nargs="*", default=[], help="HF safetensors directories (else random-init)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--tiny", action="store_true", help="tiny random model, 6 short prompts: a dry run")
    ap.add_argument("--compile", default="off,on", help="engine.compile modes, comma-separated")
    ap.add_argument("--cuda-graphs", default=None,
                    help="engine.cuda_graphs modes, comma-separated (default: on,off on CUDA, off elsewhere; "
                         "'uncaptured': the graphs' padded forward without capture, a CPU dry run of that path)")
    ap.add_argument("--drafters", default="none,ngram,ngram-tree",
                    help="none | ngram (a single path) | ngram-tree (a token tree of 16 tokens)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=100)
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--g", type=int, default=4, help="draft tokens per round")
    ap.add_argument("--config-s", type=float, default=8.0, help="timed seconds per configuration, at most")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no configuration starts after this")
    ap.add_argument("--hbm-bytes-per-s", type=float, default=H200_HBM_BYTES_PER_S)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_bench.json when $OUT is set)")
    args = ap.parse_args(argv)
    if args.cuda_graphs is None:
        args.cuda_graphs = "on,off" if args.device.startswith("cuda") else "off"
    if args.tiny:
        args.num_prompts, args.min_prompt, args.max_prompt, args.max_tokens = 6, 20, 40, 16
    if args.out is None and os.environ.get("OUT"):
        args.out = str(Path(os.environ["OUT"]) / "gpu_bench.json")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    report = {"environment": environment(args), "models": []}
    print(f"gpu_bench: {report['environment']}", flush=True)
    if not args.model_dir:
        print("no --model-dir: random-init models of the real shapes; plain-decoding speed is honest, "
              "n-gram acceptance is meaningless", flush=True)
    for name, kind, load in models_to_run(args):
        if time.monotonic() - t_start > args.budget_s:
            print(f"== {name}: skipped (budget spent)", flush=True)
            report["models"].append({"model": name, "kind": kind, "skipped": "budget"})
            continue
        model = load()
        bench_model(name, kind, model, args, report, t_start)
        del model
        gc.collect()
    write_report(report, args.out)
    print(f"gpu_bench: done in {time.monotonic() - t_start:.0f} s" + (f", JSON in {args.out}" if args.out else ""),
          flush=True)


if __name__ == "__main__":
    main()
