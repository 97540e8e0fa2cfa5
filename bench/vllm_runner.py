"""vLLM CPU peer for the benchmark: greedy offline `LLM.generate` on pre-tokenized prompts.

Runs with bench/.venv-vllm/bin/python (bench/setup_vllm.sh), never with the project venv, and imports
nothing from our package: prompts arrive as token ids (chat template already applied), results leave
as JSON. It knows nothing about prompt sets, our engine, or Hugging Face baselines.

    bench/.venv-vllm/bin/python bench/vllm_runner.py --model-dir DIR --prompts-json P.json \
        --max-tokens 128 --mode plain|ngram|suffix|draft [--draft-dir DIR] --batch all|1 --out R.json

Timing: tokens_per_s = new tokens / wall time of the timed `generate` calls; model load (with vLLM's
compilation) and a short warm-up `generate` are excluded and reported apart. Spec-decode counters are
differences of vLLM's Prometheus counters across the timed calls only.
Outputs are the generated token ids as vLLM returns them (the EOS token kept when it stopped on EOS).
Top-level acceptance_rate / mean_tokens_per_round / peak_rss_mb mirror bench/run_one.py's keys.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SPEC_COUNTERS = {  # our key -> vLLM counter
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="Hugging Face model directory (safetensors)")
    p.add_argument("--prompts-json", required=True, help="JSON list of token id lists")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--mode", choices=["plain", "ngram", "suffix", "draft"], default="plain")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (free-text rows)")
    p.add_argument("--ngram-k", type=int, default=4, help="draft tokens per step (n-gram and draft modes)")
    p.add_argument("--draft-dir", help="draft model directory (draft mode): same tokenizer as the target")
    p.add_argument("--ngram-min", type=int, default=2, help="prompt_lookup_min (n-gram mode)")
    p.add_argument("--ngram-max", type=int, default=4, help="prompt_lookup_max (n-gram mode)")
    p.add_argument("--n-b1", type=int, default=8, help="prompts for the batch-1 runs (a prefix)")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats in this process (one load)")
    p.add_argument("--batch", choices=["all", "1", "all,1"], default="all",
                   help="all: one generate call with every prompt; 1: one call per prompt")
    p.add_argument("--threads", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND (cores to bind)")
    p.add_argument("--kv-cache-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="scheduler token budget per step (vLLM's default when unset); the start-up "
                        "profiling run is one forward of this many tokens")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefix-caching", action="store_true",
                   help="vLLM's automatic prefix caching (reset before every timed run, so each starts cold)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="running sequences at most (vLLM's default when unset); with --batch all: batch N")
    p.add_argument("--formats-json", default=None,
                   help="JSON list, one per prompt: null or a response_format object (json_schema, json_object, "
                        "regex, choice, grammar): vLLM's structured outputs with --structured-backend")
    p.add_argument("--structured-backend", default="guidance", help="vLLM structured_outputs backend")
    p.add_argument("--out", required=True, help="result JSON path")
    return p.parse_args(argv)


def set_cpu_env(args: argparse.Namespace) -> None:
    """vLLM reads these at import and engine start: set them before importing vllm."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.threads)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))


def build_llm(args: argparse.Namespace):
    from vllm import LLM

    kwargs = dict(model=args.model_dir, dtype=args.dtype, enable_prefix_caching=args.prefix_caching, seed=0,
                  max_model_len=args.max_model_len, disable_log_stats=False)
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.formats_json:
        kwargs["structured_outputs_config"] = {"backend": args.structured_backend, "disable_any_whitespace": True}
    if args.mode == "ngram":
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram_k,
                                        "prompt_lookup_max": args.ngram_max,
                                        "prompt_lookup_min": args.ngram_min}
    elif args.mode == "suffix":          # SuffixDecoding through the arctic-inference package
        kwargs["speculative_config"] = {"method": "suffix", "num_speculative_tokens": args.ngram_k}
    elif args.mode == "draft":
        if not args.draft_dir:
            raise SystemExit("--mode draft needs --draft-dir")
        kwargs["speculative_config"] = {"method": "draft_model", "model": args.draft_dir,
                                        "num_speculative_tokens": args.ngram_k}
    return LLM(**kwargs)


def spec_counters(llm) -> dict[str, int]:
    """Current totals of the spec-decode counters (0 when vLLM has not created them)."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0)
    by_name = {v: k for k, v in SPEC_COUNTERS.items()}
    for metric in llm.get_metrics():
        key = by_name.get(metric.name)
        if key is not None and hasattr(metric, "value"):
            totals[key] += int(metric.value)
    return totals


def structured(fmt: dict | None):
    """vLLM's StructuredOutputsParams for a response_format object (None: free text)."""
    from vllm.sampling_params import StructuredOutputsParams

    if fmt is None:
        return None
    kind = fmt["type"]
    if kind == "json_schema":
        body = fmt["json_schema"]
        schema = body["schema"] if isinstance(body, dict) and "schema" in body and "type" not in body else body
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    return StructuredOutputsParams(**{kind: fmt[kind]})


def generate(llm, prompts: list[list[int]], params, batch: str) -> list:
    """params: one SamplingParams for all, or a list (one per prompt)."""
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    if batch == "all":
        return llm.generate(requests, params, use_tqdm=False)
    per = params if isinstance(params, list) else [params] * len(requests)
    return [out for r, sp in zip(requests, per) for out in llm.generate([r], sp, use_tqdm=False)]


def spec_summary(before: dict[str, int], after: dict[str, int]) -> dict:
    """Counter differences plus acceptance rate and mean acceptance length (1 + accepted / drafts,
    vLLM's convention: tokens emitted per verification round, bonus/recovered token included)."""
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None
    return d


def process_tree_rss_mb() -> float:
    """This process's peak RSS plus the current RSS of its children (vLLM's engine core and worker
    run in child processes), in MB."""
    import resource

    import psutil

    children = psutil.Process().children(recursive=True)
    child_bytes = sum(c.memory_info().rss for c in children if c.is_running())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 + child_bytes / 2**20


def run(args: argparse.Namespace) -> dict:
    set_cpu_env(args)
    import vllm
    from vllm import SamplingParams

    with open(args.prompts_json) as f:
        prompts = json.load(f)
    t0 = time.perf_counter()
    llm = build_llm(args)
    load_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    generate(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=4), "all")
    warmup_s = time.perf_counter() - t0

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=False)
    if args.formats_json:
        with open(args.formats_json) as f:
            formats = json.load(f)
        params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=structured(fmt))
                  for fmt in formats]
    runs = []
    for batch in args.batch.split(","):
        for rep in range(args.repeats):
            n = len(prompts) if batch == "all" else args.n_b1
            runs.append(timed_run(llm, prompts[:n], params[:n] if isinstance(params, list) else params, batch, args))
            runs[-1].update({"repeat": rep, "load_s": load_s, "warmup_s": warmup_s,
                             "vllm_version": vllm.__version__})
    return {"runs": runs, **runs[0]}


def timed_run(llm, prompts, params, batch: str, args) -> dict:
    if args.prefix_caching:         # every timed run starts cold, as ours does (one process per run)
        llm.reset_prefix_cache()
    before = spec_counters(llm)
    t0 = time.perf_counter()
    outs = generate(llm, prompts, params, batch)
    wall_s = time.perf_counter() - t0
    spec = spec_summary(before, spec_counters(llm)) if args.mode != "plain" else None
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    total = sum(len(o) for o in outputs)
    return {"name": f"vllm_{args.mode}_b{batch}", "mode": args.mode, "batch": batch, "num_prompts": len(prompts),
            "max_tokens": args.max_tokens, "total_prompt_tokens": sum(len(p) for p in prompts),
            "total_new_tokens": total, "wall_s": wall_s, "tokens_per_s": total / wall_s, "spec": spec,
            "acceptance_rate": spec and spec["acceptance_rate"],
            "mean_tokens_per_round": spec and spec["mean_acceptance_length"], "peak_rss_mb": process_tree_rss_mb(),
            "finish_reasons": [o.outputs[0].finish_reason for o in outs], "outputs": outputs,
            "prefix_caching": args.prefix_caching,
            "prefix_cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    brief = {k: v for k, v in result.items() if k not in ("outputs", "finish_reasons", "runs")}
    print(json.dumps(brief), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
