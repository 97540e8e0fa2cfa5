"""One benchmark configuration in a fresh process (so peak RSS is its own), printed as JSON.

    python -m bench.run_one --model smollm2 --mode engine --drafter ngram --batch 32 --prompts P.json --out R.json

Modes: engine (ours; --drafter none|ngram|suffix|draft|hybrid, --adaptive, --batch = max_num_seqs with every
prompt queued at once), hf-static (HF generate, static batches of --batch), hf-plain (HF batch 1),
hf-assisted (HF assisted generation with the draft model, batch 1), hf-lookup (HF prompt lookup,
batch 1). Each run warms up on two short prompts outside the clock.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from dataclasses import replace

import torch

from bench import hf_baselines
from bench.common import MODELS, load_json, load_prompts
from pipeline.engine import DraftingConfig, EngineConfig, Kernels, SuffixParams, TreeParams
from pipeline.job.config import ModelsConfig
from pipeline.engine import SamplingParams
from pipeline.loading.hardware import resolve_dtype
from pipeline.loading.models import ModelSpec, load_model
from pipeline.job.runtime import build_engine
from pipeline.job.validity import check_record

def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    """RSS now (after the run): the peak also counts transient load-time pages (e.g. the checkpoint's
    memory map while the engine packs its weights)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run_engine(args, prompts: list[list[int]]) -> dict:
    target, draft = MODELS[args.model]
    drafter = args.drafter
    drafting = DraftingConfig(method=drafter, num_speculative_tokens=args.g, adaptive=args.adaptive,
                              draft_sample_method="greedy", ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                              suffix=SuffixParams(**json.loads(args.suffix)), hybrid_proposer=args.hybrid_proposer,
                              forced_tokens=args.forced_tokens == "on",
                              tree=TreeParams(max_tokens=args.tree_tokens, max_branches=args.tree_branches,
                                              sampled=args.tree_sampled))
    models = ModelsConfig(target=target, draft=draft if drafting.uses_draft_model else None,
                          dtype=args.dtype, draft_dtype=args.draft_dtype, device=args.device)
    max_len = max(len(p) for p in prompts) + args.max_tokens + 8
    section = EngineConfig(max_num_seqs=args.batch, max_model_len=max_len, max_prefill_tokens=2048,
                           compile=args.compile, prefix_reuse=args.prefix_reuse == "on")
    kernels = Kernels(cpu_linear=args.cpu_linear, cpu_fused=args.cpu_fused, cpu_decoder=args.cpu_decoder)
    loaded = build_engine(models, drafting, section, kernels)
    print("\n".join(([loaded.slots_reason] if loaded.slots_reason else []) + loaded.plan_lines()), file=sys.stderr)
    engine = loaded.engine
    if args.calibrate or args.adaptive:
        engine.calibrate()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    formats = load_json(args.formats) if args.formats else [None] * len(prompts)
    params = [replace(params, response_format=f) for f in formats[:len(prompts)]]
    _drain(engine, prompts[:2], [replace(p, max_tokens=8) for p in params[:2]], "warm")
    engine.reset_prefix_cache()           # the warm-up's prompts must not be reused by the timed run
    draft_runner = engine.drafter.draft_runner if engine.drafter is not None else None
    forwarded = (engine.target.num_forward_tokens, draft_runner.num_forward_tokens if draft_runner else 0)
    grammar_before = engine.grammar_s
    t0 = time.perf_counter()
    done, rounds = _drain(engine, prompts, params, "p", seed=args.seed)
    wall = time.perf_counter() - t0
    outputs = [done[f"p{i}"].output_ids for i in range(len(prompts))]
    completions = [done[f"p{i}"] for i in range(len(prompts))]
    constrained = [c for c in completions if c.response_format is not None]
    valid = [check_record(c.text, c.response_format)[0] if c.valid else False for c in constrained]
    drafted = sum(r.draft_len for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    steps = {}
    for r in rounds:    # per step: batch size, target tokens, draft steps (for the cost model)
        s = steps.setdefault(r.step, [r.batch_size, 0, 0, r.draft_s, r.verify_s])
        s[1] += r.draft_len + 1
        s[2] = max(s[2], r.draft_len)
    new_tokens = sum(len(o) for o in outputs)
    return {"tokens_per_s": new_tokens / wall, "total_new_tokens": new_tokens, "wall_s": wall,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_tokens_per_round": new_tokens / len(rounds), "num_rounds": len(rounds),
            "draft_s": sum(s[3] for s in steps.values()), "verify_s": sum(s[4] for s in steps.values()),
            "steps": list(steps.values()), "outputs": outputs,
            "verify_curve": engine.costs.verify_curve, "draft_curve": engine.costs.draft_curve,
            "prompt_tokens": sum(len(p) for p in prompts),
            "prefix_reused_tokens": engine.prefixes.num_reused if engine.prefixes is not None else 0,
            # tokens each model forwarded in the timed run (prefill, catch-up, drafts, verification)
            "target_forward_tokens": engine.target.num_forward_tokens - forwarded[0],
            "draft_forward_tokens": (draft_runner.num_forward_tokens - forwarded[1]) if draft_runner else 0,
            "kernels": loaded.plan_lines(), "max_num_seqs": engine.config.max_num_seqs,
            "slots_reason": loaded.slots_reason,
            "num_steps": len(steps), "grammar_s": engine.grammar_s - grammar_before, "finish_reasons": [c.finish_reason for c in completions],
            "constrained": len(constrained), "valid": sum(valid),
            "valid_of_finished": (sum(valid) / sum(c.finish_reason in ("eos", "stop") for c in constrained)
                                  if any(c.finish_reason in ("eos", "stop") for c in constrained) else None),
            "forced_drafted": sum(r.forced for r in rounds), "forced_accepted": sum(r.forced_accepted for r in rounds),
            "own_acceptance": ((accepted - sum(r.forced_accepted for r in rounds))
                               / max(1, drafted - sum(r.forced for r in rounds))),
            "accepted_per_round": accepted / len(rounds), "mean_draft_len": drafted / len(rounds),
            "tree_rounds": sum(r.paths > 1 for r in rounds) / len(rounds)}


def _drain(engine, prompts, params, prefix, seed: int = 0):
    """params: one SamplingParams for all, or one per prompt."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params[i] if isinstance(params, list) else params, seed=seed)
    done, rounds = {}, []
    while engine.has_unfinished():
        out = engine.step()
        rounds.extend(out.rounds)
        done.update({c.request_id: c for c in out.finished})
    return done, rounds


def run_hf(args, prompts: list[list[int]]) -> dict:
    target, draft = MODELS[args.model]
    model, tok = load_model(ModelSpec(target, args.dtype, args.device))
    if args.mode == "hf-static":
        res = hf_baselines.hf_static_batch(model, tok, prompts, args.max_tokens, batch_size=args.batch)
    elif args.mode == "hf-plain":
        res = hf_baselines.hf_plain_batch1(model, tok, prompts, args.max_tokens)
    elif args.mode == "hf-lookup":
        res = hf_baselines.hf_prompt_lookup(model, tok, prompts, args.max_tokens, num_tokens=args.g)
    else:
        draft_model, _ = load_model(ModelSpec(draft, args.dtype, args.device))
        res = hf_baselines.hf_assisted(model, draft_model, tok, prompts, args.max_tokens)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(MODELS), default="smollm2")
    ap.add_argument("--mode", choices=["engine", "hf-static", "hf-plain", "hf-assisted", "hf-lookup"])
    ap.add_argument("--drafter", default="none", choices=["none", "ngram", "suffix", "draft", "hybrid"])
    ap.add_argument("--adaptive", action="store_true")
    ap.add_argument("--hybrid-proposer", default="ngram", choices=["ngram", "suffix"],
                    help="hybrid's free first part (drafting.hybrid_proposer)")
    ap.add_argument("--calibrate", action="store_true", help="measure cost curves (for the speedup model)")
    ap.add_argument("--batch", type=lambda v: v if v == "auto" else int(v), default=16,
                    help="engine: max_num_seqs (an integer or auto); HF static: the batch size")
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--suffix", default="{}", help='drafting.suffix fields as JSON, e.g. {"max_spec_factor": 2}')
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="auto (this machine decides: pipeline/loading/hardware.py) "
                    "| float32 | bfloat16 | float16")
    ap.add_argument("--draft-dtype", default="same", help="models.draft_dtype: same (as --dtype) | auto | "
                    "float32 | bfloat16 | float16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled runs: each request samples from its own generator (seeded by its id and --seed)")
    ap.add_argument("--seed", type=int, default=0, help="every request's seed: sampled runs with another seed draw other texts")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="engine.compile")
    ap.add_argument("--cpu-linear", default="auto", choices=["auto", "on", "off"], help="Kernels.cpu_linear (a switch under engine.kernels)")
    ap.add_argument("--cpu-fused", default="auto", choices=["auto", "on", "off"], help="Kernels.cpu_fused (a switch under engine.kernels)")
    ap.add_argument("--cpu-decoder", default="auto", choices=["auto", "on", "off"], help="Kernels.cpu_decoder (a switch under engine.kernels)")
    ap.add_argument("--prefix-reuse", default="on", choices=["on", "off"], help="engine.prefix_reuse")
    ap.add_argument("--prompts", required=True, help="JSON list of token id lists")
    ap.add_argument("--formats", default=None, help="JSON list, one per prompt: null or a response_format object")
    ap.add_argument("--forced-tokens", default="on", choices=["on", "off"], help="drafting.forced_tokens")
    ap.add_argument("--tree-tokens", type=int, default=0, help="drafting.tree.max_tokens (0: single paths)")
    ap.add_argument("--tree-branches", type=int, default=4, help="drafting.tree.max_branches")
    ap.add_argument("--tree-sampled", action="store_true", help="drafting.tree.sampled")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, args.device)
    print(f"dtype: {dtype.describe()}", file=sys.stderr, flush=True)
    args.dtype = dtype.dtype                      # every system below runs in the resolved dtype
    prompts = load_prompts(args.prompts)
    res = run_engine(args, prompts) if args.mode == "engine" else run_hf(args, prompts)
    res.update({"mode": args.mode, "drafter": args.drafter, "adaptive": args.adaptive, "batch": args.batch,
                "model": args.model, "dtype": args.dtype, "dtype_reason": dtype.reason,
                "draft_dtype": args.draft_dtype, "num_prompts": len(prompts),
                "peak_rss_mb": peak_rss_mb(), "end_rss_mb": current_rss_mb()})
    with open(args.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
