"""The benchmark: every configuration side by side, same machine, same prompts, one invocation.

    .venv/bin/python -m bench.bench --model smollm2 --repeats 3 --out bench/out/smollm2.json

Each configuration runs in its own process (bench/run_one.py, or bench/vllm_runner.py inside
bench/.venv-vllm for vLLM's CPU build), one after another, `--repeats` times, interleaved so that
drift hits every configuration alike (ours in reverse order on odd repeats, so none always runs first): each repeat runs all of ours, then vLLM's (one load per mode and
repeat, both batch settings), so a ratio's two sides come from the same stretch of time. Reported: median tokens/s with min-max spread, acceptance,
tokens per round, peak RSS, the fraction of outputs identical to our engine without a draft, and the
speedup our cost model predicts from the measured acceptance and the calibrated draft and verify
costs (see bench/RESULTS.md for the model). Prompt-prefix caching is the same on both sides
(--prefix-cache: our engine.prefix_reuse and vLLM's automatic prefix caching, on by default as in
both systems; vLLM's is reset before each timed run, since each of ours starts in a fresh process).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import MODELS, VLLM_PY, load_json, load_prompts, run_config, run_vllm_runner, spread
from pipeline.loading.hardware import resolve_dtype


def suite(model: str, n_all: int, n_b1: int, all_seqs: int | str = 32, compile: str = "auto",
          cpu_linear: str = "auto", cpu_fused: str = "auto", cpu_decoder: str = "auto",
          prefix_cache: str = "on") -> list[dict]:
    """(name, prompts slice, run_one args or vllm args). `ref` marks the reference of each group.
    all_seqs: our engine's max_num_seqs for the all-at-once configurations (running sequences)."""
    spec = "ngram" if model == "smollm2" else "draft"
    eng = lambda drafter, batch, *extra: ["--mode", "engine", "--drafter", drafter, "--batch", str(batch),
                                          "--compile", compile, "--cpu-linear", cpu_linear,
                                          "--cpu-fused", cpu_fused, "--cpu-decoder", cpu_decoder,
                                          "--prefix-reuse", prefix_cache, *extra]
    configs = [
        # all prompts at once
        {"name": "hf_static_b16", "n": n_all, "args": ["--mode", "hf-static", "--batch", "16"]},
        {"name": "ours_none_all", "n": n_all, "args": eng("none", all_seqs, "--calibrate"), "ref": True},
        {"name": f"ours_{spec}_all", "n": n_all, "args": eng(spec, all_seqs, "--calibrate"), "base": "ours_none_all"},
        {"name": f"ours_adaptive_{spec}_all", "n": n_all, "args": eng(spec, all_seqs, "--adaptive"),
         "base": "ours_none_all"},
        # batch 1
        {"name": "hf_plain_b1", "n": n_b1, "args": ["--mode", "hf-plain"]},
        {"name": "hf_lookup_b1" if spec == "ngram" else "hf_assisted_b1", "n": n_b1,
         "args": ["--mode", "hf-lookup" if spec == "ngram" else "hf-assisted"], "base": "hf_plain_b1"},
        {"name": "ours_none_b1", "n": n_b1, "args": eng("none", 1, "--calibrate"), "ref": True},
        {"name": f"ours_{spec}_b1", "n": n_b1, "args": eng(spec, 1, "--calibrate"), "base": "ours_none_b1"},
        {"name": f"ours_adaptive_{spec}_b1", "n": n_b1, "args": eng(spec, 1, "--adaptive"), "base": "ours_none_b1"},
    ]
    if model == "smollm2":  # the suffix drafter (worker-wide index over finished outputs) next to n-gram
        configs += [{"name": "ours_suffix_all", "n": n_all, "args": eng("suffix", all_seqs, "--calibrate"),
                     "base": "ours_none_all"},
                    {"name": "ours_suffix_b1", "n": n_b1, "args": eng("suffix", 1, "--calibrate"),
                     "base": "ours_none_b1"}]
    for batch in (4, 16):   # adaptive must never lose more than 5% to no speculation, at any batch size
        configs += [{"name": f"ours_none_b{batch}", "n": n_all, "args": eng("none", batch), "ref": True},
                    {"name": f"ours_adaptive_{spec}_b{batch}", "n": n_all, "args": eng(spec, batch, "--adaptive"),
                     "base": f"ours_none_b{batch}"}]
    if model == "qwen":     # the draft model in bf16 beside the target in the run's dtype (models.draft_dtype)
        for batch, n, name in ((all_seqs, n_all, "all"), (1, n_b1, "b1")):
            configs += [{"name": f"ours_draft_bf16draft_{name}", "n": n, "base": f"ours_none_{name}",
                         "args": eng("draft", batch, "--calibrate", "--draft-dtype", "bfloat16")},
                        {"name": f"ours_adaptive_draft_bf16draft_{name}", "n": n, "base": f"ours_none_{name}",
                         "args": eng("draft", batch, "--adaptive", "--draft-dtype", "bfloat16")}]
    if VLLM_PY.exists():    # one process per mode and repeat runs both batch settings
        for mode, base in (("plain", None), (spec, "plain")):
            for batch, n in (("all", n_all), ("b1", n_b1)):
                configs.append({"name": f"vllm_{mode}_{batch}", "n": n, "vllm": mode,
                                **({"base": f"vllm_{base}_{batch}"} if base else {})})
    return configs


def run_vllm(mode: str, model: str, prompts_file: Path, n_b1: int, repeats: int, out: Path,
             common: list[str], prefix_cache: str = "on") -> dict[str, list[dict]]:
    """vLLM's CPU build in its own venv: one load, batch all and batch 1, `repeats` times each."""
    from pipeline.loading.models import resolve_hf_dir
    arg = lambda k: common[common.index(k) + 1]
    target, draft = MODELS[model]
    extra = ["--draft-dir", str(resolve_hf_dir(draft))] if mode == "draft" else []
    extra += ["--prefix-caching"] if prefix_cache == "on" else []
    res = run_vllm_runner(resolve_hf_dir(target), prompts_file, out, mode=mode, batch="all,1",
                          max_tokens=arg("--max-tokens"), dtype=arg("--dtype"), n_b1=n_b1, repeats=repeats,
                          extra=extra)
    if "error" in res:
        return {f"vllm_{mode}_{b}": [res] for b in ("all", "b1")}
    return {f"vllm_{mode}_all": [r for r in res["runs"] if r["batch"] == "all"],
            f"vllm_{mode}_b1": [r for r in res["runs"] if r["batch"] == "1"]}


def predicted_speedup(spec: dict, base: dict) -> float | None:
    """Our cost model: time = sum over steps of V(target tokens) + draft steps x D(batch) (n-gram:
    its measured lookup time), with V, D the calibrated curves of the speculative run's process."""
    from pipeline.engine.drafting.cost import CostModel
    if not spec.get("verify_curve") or not spec.get("steps") or not base.get("steps"):
        return None
    cm = CostModel()
    cm.verify_curve = [tuple(p) for p in spec["verify_curve"]]
    cm.draft_curve = [tuple(p) for p in spec.get("draft_curve") or []]
    t_spec = sum(cm.verify_cost(s[1]) + (s[2] * cm.draft_cost(s[0]) if cm.draft_curve else s[3])
                 for s in spec["steps"])
    t_base = sum(cm.verify_cost(s[1]) for s in base["steps"])
    return (t_base / base["total_new_tokens"]) / (t_spec / spec["total_new_tokens"])


def summarise(configs: list[dict], runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for cfg in configs:
        ok = [r for r in runs[cfg["name"]] if "error" not in r]
        if not ok:
            rows.append({"name": cfg["name"], "error": runs[cfg["name"]][0].get("error", "")[-500:]})
            continue
        tps = [r["tokens_per_s"] for r in ok]
        med = ok[sorted(range(len(ok)), key=lambda i: tps[i])[len(ok) // 2]]
        tok_s = spread(tps)
        row = {"name": cfg["name"], "n": cfg["n"], "tok_s": tok_s["median"], "min": tok_s["min"], "max": tok_s["max"],
               "acceptance": med.get("acceptance_rate"), "tokens_per_round": med.get("mean_tokens_per_round"),
               "peak_rss_mb": max(r.get("peak_rss_mb", 0) for r in ok), "runs": len(ok), "_med": med}
        rows.append(row)
    by_name = {r["name"]: r for r in rows}
    for cfg, row in zip(configs, rows):
        if "error" in row:
            continue
        ref_name = _reference(cfg, by_name)
        if ref_name and "_med" in by_name.get(ref_name, {}):
            ref_out = by_name[ref_name]["_med"].get("outputs")
            outs = row["_med"].get("outputs")
            if ref_out and outs:
                row["identical_to_ours_none"] = sum(a == b for a, b in zip(outs, ref_out)) / len(ref_out)
        if cfg.get("base") and "_med" in by_name.get(cfg["base"], {}):
            row["speedup"] = row["tok_s"] / by_name[cfg["base"]]["tok_s"]
            pred = predicted_speedup(row["_med"], by_name[cfg["base"]]["_med"])
            if pred:
                row["predicted_speedup"] = pred
                row["measured_over_predicted"] = row["speedup"] / pred
    return rows


def _reference(cfg: dict, by_name: dict) -> str | None:
    """Outputs are compared with our no-draft engine on the same prompt set."""
    return "ours_none_all" if cfg["n"] == by_name.get("ours_none_all", {}).get("n") else "ours_none_b1"


def markdown(rows: list[dict]) -> str:
    head = ("| config | prompts | tok/s median [min-max] | acceptance | tokens/round | peak RSS MB | "
            "identical to ours_none | speedup vs base | predicted | measured/predicted | useful GFLOP/s | of peak |"
            "\n|" + "---|" * 12)
    lines = [head]
    fmt = lambda v, f="{:.2f}": "" if v is None else f.format(v)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error'][-120:]!r} |" + " |" * 10)
            continue
        lines.append(f"| {r['name']} | {r['n']} | {r['tok_s']:.1f} [{r['min']:.1f}-{r['max']:.1f}] | "
                     f"{fmt(r['acceptance'])} | {fmt(r['tokens_per_round'])} | {r['peak_rss_mb']:.0f} | "
                     f"{fmt(r.get('identical_to_ours_none'), '{:.0%}')} | {fmt(r.get('speedup'))} | "
                     f"{fmt(r.get('predicted_speedup'))} | {fmt(r.get('measured_over_predicted'), '{:.0%}')} | "
                     f"{fmt(r.get('gflops'), '{:.1f}')} | {fmt(r.get('peak_fraction'), '{:.0%}')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen"])
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists (chat template applied)")
    ap.add_argument("--n-all", type=int, default=64)
    ap.add_argument("--n-b1", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="every system runs in this dtype; auto: what "
                    "pipeline/loading/hardware.py picks for this machine's CPU (resolved once, here)")
    ap.add_argument("--all-seqs", type=lambda v: v if v == "auto" else int(v), default=32,
                    help="our max_num_seqs in the all-at-once configurations (an integer, or auto: measured)")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="our engine.compile")
    ap.add_argument("--cpu-linear", default="auto", choices=["auto", "on", "off"],
                    help="our Kernels.cpu_linear switch (off: oneDNN-packed linears)")
    ap.add_argument("--cpu-fused", default="auto", choices=["auto", "on", "off"],
                    help="our Kernels.cpu_fused switch (off: the model's own RMSNorm and MLP modules)")
    ap.add_argument("--cpu-decoder", default="auto", choices=["auto", "on", "off"],
                    help="our Kernels.cpu_decoder switch (off: the model's forward over our kernels)")
    ap.add_argument("--prefix-cache", default="on", choices=["on", "off"],
                    help="both sides alike: our engine.prefix_reuse and vLLM's automatic prefix caching "
                         "(reset before each of its timed runs)")
    ap.add_argument("--only", nargs="*", help="run only these config names")
    ap.add_argument("--from-files", action="store_true", help="only summarise the run files already written")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prompts = load_prompts(args.prompts)
    workdir = Path(args.out).with_suffix("")
    workdir.mkdir(parents=True, exist_ok=True)
    files = {}
    for n in {args.n_all, args.n_b1}:
        files[n] = workdir / f"prompts_{n}.json"
        json.dump(prompts[:n], open(files[n], "w"))
    configs = [c for c in suite(args.model, args.n_all, args.n_b1, args.all_seqs, args.compile, args.cpu_linear,
                                 args.cpu_fused, args.cpu_decoder, args.prefix_cache)
               if not args.only or c["name"] in args.only]
    dtype = resolve_dtype(args.dtype, "cpu")     # concrete for every system (vLLM's own `auto` differs)
    print(f"dtype: {dtype.describe()}", flush=True)
    args.dtype = dtype.dtype                      # recorded, and the matmul peak's dtype
    common = ["--max-tokens", str(args.max_tokens), "--dtype", dtype.dtype]
    runs: dict[str, list[dict]] = {c["name"]: [] for c in configs}
    if args.from_files:
        report(configs, load_runs(configs, workdir), args)
        return
    ours = [c for c in configs if "vllm" not in c]
    modes = sorted({c["vllm"] for c in configs if "vllm" in c})
    for rep in range(args.repeats):
        for cfg in (ours if rep % 2 == 0 else ours[::-1]):   # ABBA: no configuration always runs first
            res = run_config(cfg, args.model, files[cfg["n"]], workdir / f"{cfg['name']}_{rep}.json", common)
            runs[cfg["name"]].append(res)
            print(f"[{rep}] {cfg['name']}: " + (f"{res['tokens_per_s']:.1f} tok/s" if "error" not in res
                                                 else "FAILED " + res["error"][-300:]), flush=True)
            if rep == 0 and "kernels" in res:
                print("    kernels: " + "; ".join(res["kernels"]), flush=True)
            if rep == 0 and res.get("slots_reason"):
                print(f"    max_num_seqs {res['max_num_seqs']}: {res['slots_reason']}", flush=True)
        for mode in modes:
            got = run_vllm(mode, args.model, files[args.n_all], args.n_b1, 1,
                           workdir / f"vllm_{mode}_{rep}.json", common, args.prefix_cache)
            for k, v in got.items():
                if k in runs:
                    runs[k] += v
            print(f"[{rep}] vllm {mode}: " + ", ".join(f"{k} {[round(r.get('tokens_per_s', 0), 1) for r in v]}"
                                                       for k, v in got.items()), flush=True)
    report(configs, runs, args)


def load_runs(configs: list[dict], workdir: Path) -> dict[str, list[dict]]:
    runs = {c["name"]: sorted(workdir.glob(f"{c['name']}_[0-9].json")) for c in configs}
    runs = {k: [load_json(f) for f in v] for k, v in runs.items()}
    for mode in ("plain", "ngram", "draft"):
        res = [r for f in sorted(workdir.glob(f"vllm_{mode}_[0-9].json")) for r in load_json(f)["runs"]]
        if res:
            runs[f"vllm_{mode}_all"] = [r for r in res if r["batch"] == "all"]
            runs[f"vllm_{mode}_b1"] = [r for r in res if r["batch"] == "1"]
    return {k: v for k, v in runs.items() if v}


def matmul_peak_gflops(dtype: str, threads: int = 2, size: int = 2048, repeats: int = 5) -> float:
    """This machine's matmul peak: the best of `repeats` [size x size] @ [size x size] in `dtype`."""
    import torch
    torch.set_num_threads(threads)
    a = torch.randn(size, size, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, dtype=getattr(torch, dtype))
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size ** 3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def num_params(model: str) -> int:
    """Weights the forward multiplies by (the target's safetensors; a tied head counted once, as used)."""
    from safetensors import safe_open
    from pipeline.loading.models import resolve_hf_dir
    total = 0
    for f in resolve_hf_dir(MODELS[model][0]).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(_numel(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def add_flops(rows: list[dict], prompt_tokens: dict[int, int], params: int, peak: float) -> None:
    """Useful GFLOP/s per configuration: 2 x parameters x (prompt + generated tokens) / wall, the work
    plain decoding must do (attention and rejected drafts not counted), and its fraction of the peak."""
    for r in rows:
        if "error" in r:
            continue
        new = r["_med"].get("total_new_tokens") or r["tok_s"] * r["_med"].get("wall_s", 0) or None
        if not new:
            continue
        r["gflops"] = 2 * params * r["tok_s"] * (1 + prompt_tokens[r["n"]] / new) / 1e9
        r["peak_fraction"] = r["gflops"] / peak


def report(configs: list[dict], runs: dict[str, list[dict]], args) -> None:
    configs = [c for c in configs if runs.get(c["name"])]
    rows = summarise(configs, runs)
    prompts = load_prompts(args.prompts)
    peak = matmul_peak_gflops(args.dtype)
    add_flops(rows, {n: sum(len(p) for p in prompts[:n]) for n in {args.n_all, args.n_b1}},
              num_params(args.model), peak)
    table = markdown(rows) + f"\n\nmatmul peak on this machine ({args.dtype}, 2 threads, 2048^3 torch.mm): {peak:.1f} GFLOP/s"
    print(table)
    json.dump({"args": vars(args), "rows": [{k: v for k, v in r.items() if k != "_med"} for r in rows]},
              open(args.out, "w"), indent=1)
    Path(args.out).with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
