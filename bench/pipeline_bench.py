"""The whole job against the engine alone, on the same real prompts and model.

    .venv/bin/python -m bench.pipeline_bench --suite --n 32 --max-tokens 64 --repeats 3 --out bench/out/pipeline.json
    .venv/bin/python -m bench.pipeline_bench --suite --configs job-1w-2t processor-1r-2t --n 64 --max-tokens 128 --batch 32 --rows-per-unit 16 --repeats 3 --out bench/out/processor.json
    (and --configs job-1w-1t processor-1r-1t: one thread each, a core left to Ray Data's driver and actors)

Each measurement runs in a fresh process (--one), alternating configurations across repeats:
- engine:  build_engine + SpecEngine.run over the pre-tokenized prompts, all queued at once, after a
           warm-up (the engine's own time; no files, no Ray).
- job:     jobs/generate.py's run_job on a local Ray it starts (the README demo's path): prompts read
           from Parquet shards, tokenized in the worker, outputs committed to local disk. Reported:
           wall (plan -> _SUCCESS, incl. Ray start and model load), workers_ready (actor start + load)
           and generate (first unit handed out -> last unit committed).
- processor: the same rows through the Ray Data processor (pipeline/processor/) on a local Ray it
           starts, one replica: read_parquet -> processor -> rows back. Reported: wall (Ray start ->
           last row, incl. actor start and model load), ready (Ray start -> the replica's actor alive,
           its model loaded) and generate (ready -> last row), compared with the job's wall and generate.
Pipeline overhead at 1 worker = job generate time / engine time - 1, with the same threads.
Nothing else may run on the machine meanwhile (2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m-instruct"
CONFIGS = {   # name -> (mode, workers, threads per worker)
    "engine-2t": ("engine", 1, 2),
    "job-1w-2t": ("job", 1, 2),
    "engine-1t": ("engine", 1, 1),
    "job-1w-1t": ("job", 1, 1),
    "job-2w-1t": ("job", 2, 1),
    "processor-1r-2t": ("processor", 1, 2),
    "processor-1r-1t": ("processor", 1, 1),
}


def write_shards(n: int, folder: Path, files: int = 2) -> list[dict]:
    from bench.prompts import mixed
    rows = [{"id": r["id"], "messages": r["messages"]} for r in mixed(n)]
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(rows) // files)
    for f in range(files):
        pq.write_table(pa.Table.from_pylist(rows[f * per:(f + 1) * per]), folder / f"part-{f}.parquet")
    return rows


def job_overrides(args, workers: int, threads: int, out: Path) -> list[str]:
    return [f"models.target={MODEL}", "drafting.method=ngram", "models.dtype=float32",
            f"engine.max_num_seqs={args.batch}", "engine.max_model_len=1024", "drafting.num_speculative_tokens=4",
            f"sampling.max_tokens={args.max_tokens}", "sampling.temperature=0", f"input.path={args.shards}",
            f"input.rows_per_unit={args.rows_per_unit}", f"output.path={out}", "run.run_id=bench",
            "run.progress=false", f"cluster.num_workers={workers}", f"cluster.num_cpus_per_worker={threads}"]


def run_engine(args, threads: int) -> dict:
    import torch

    from pipeline.job.config import load_config
    from pipeline.engine import SamplingParams
    from pipeline.job.rows import prompt_ids
    from pipeline.job.runtime import build_engine
    torch.set_num_threads(threads)
    cfg = load_config(None, job_overrides(args, 1, threads, Path("/tmp/unused")))
    loaded = build_engine(cfg.models, cfg.drafting, cfg.engine)
    engine, tok = loaded.engine, loaded.tokenizer
    rows = [r for f in sorted(Path(args.shards).glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    prompts = [prompt_ids(tok, None, r["messages"]) for r in rows]
    for i, p in enumerate(prompts[:2]):                                     # warm-up
        engine.add_request(f"warm{i}", p, SamplingParams(max_tokens=8, temperature=0.0))
    engine.run()
    warm_steps = engine.num_steps
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for r, p in zip(rows, prompts):
        engine.add_request(r["id"], p, params, seed=0)
    t0 = time.perf_counter()
    done = engine.run()
    wall = time.perf_counter() - t0
    tokens = sum(len(c.output_ids) for c in done)
    return {"rows": len(done), "tokens": tokens, "generate_s": wall, "tokens_per_s": tokens / wall,
            "steps": engine.num_steps - warm_steps,
            "outputs": {c.request_id: c.output_ids for c in done}}


def run_job_once(args, workers: int, threads: int) -> dict:
    import shutil

    from pipeline.cluster.driver import run_job
    from pipeline.job.config import load_config
    out = Path(args.work) / f"out-{os.getpid()}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    s = run_job(load_config(None, job_overrides(args, workers, threads, out)))
    wall = time.perf_counter() - t0
    comps = [r for f in sorted((out / "bench" / "completions").glob("*.parquet"))
             for r in pq.read_table(f, columns=["id", "token_ids"]).to_pylist()]
    shutil.rmtree(out, ignore_errors=True)
    return {"rows": s["rows"], "tokens": s["tokens"], "wall_s": wall, "generate_s": s["generate_s"],
            "ready_s": wall - s["generate_s"],      # all but generating: plan, Ray start, workers ready
            "workers_ready_s": s["workers_ready_s"], "engine_step_s": s["engine_step_s"], "steps": s["engine_steps"], "tokens_per_s": s["tokens"] / s["generate_s"],
            "end_to_end_tokens_per_s": s["tokens"] / wall, "rows_per_s": s["rows"] / s["generate_s"],
            "outputs": {c["id"]: c["token_ids"] for c in comps}}


def run_processor_once(args, replicas: int, threads: int) -> dict:
    """The same rows, model and engine settings through the Ray Data processor on a local Ray it
    starts: read_parquet -> processor -> rows back to the driver. wall: Ray start to the last row."""
    import ray
    import ray.data

    from pipeline.cluster.driver import connect
    from pipeline.job.config import ClusterConfig, load_config
    from pipeline.processor import SpecpipeProcessorConfig, build_processor
    from bench.common import ReadyWatch
    cfg = load_config(None, job_overrides(args, replicas, threads, Path("/tmp/unused")))
    t0 = time.time()
    connect(ClusterConfig(), replicas * threads + 1)          # + 1: Ray Data's read tasks beside the replicas
    watch = ReadyWatch("SpecpipeStage", t0)
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = SpecpipeProcessorConfig(models=cfg.models, drafting=cfg.drafting, engine=cfg.engine,
                                     sampling=cfg.sampling, batch_size=args.rows_per_unit, concurrency=replicas,
                                     num_cpus=threads, id_column="id")
    out = build_processor(config)(ray.data.read_parquet(args.shards)).select_columns(
        ["id", "generated_tokens", "error"]).take_all()
    wall = time.time() - t0
    ray.shutdown()
    if any(r["error"] for r in out):
        raise SystemExit(f"processor rows failed: {[r['error'] for r in out if r['error']][:3]}")
    tokens = sum(len(r["generated_tokens"]) for r in out)
    ready = watch.ready_s or float("nan")
    return {"tokens": tokens, "wall_s": wall, "end_to_end_tokens_per_s": tokens / wall, "ready_s": ready,
            "generate_s": wall - ready, "tokens_per_s": tokens / (wall - ready),
            "outputs": {r["id"]: list(r["generated_tokens"]) for r in out}}


def replica_steps(log: str) -> dict:
    """The processor replica's engine steps and their seconds, from its last summary line (it logs one
    when its engine drains; Ray forwards it to the driver's stderr); {} where there is none."""
    import re
    found = re.findall(r"replica-\w+: \d+ rows, \d+ tokens, .*?, (\d+) steps taking ([\d.]+) of", log)
    return {"steps": int(found[-1][0]), "engine_step_s": float(found[-1][1])} if found else {}


def one(args) -> None:
    mode, workers, threads = CONFIGS[args.one]
    run = {"engine": lambda: run_engine(args, threads), "job": lambda: run_job_once(args, workers, threads),
           "processor": lambda: run_processor_once(args, workers, threads)}[mode]
    result = run()
    print("RESULT " + json.dumps(result))


def suite(args) -> None:
    from bench.common import spread
    rows = write_shards(args.n, Path(args.shards))
    names = args.configs or list(CONFIGS)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.repeats):
        for name in names:
            cmd = [sys.executable, "-m", "bench.pipeline_bench", "--one", name, *_passthrough(args)]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not line:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
            results[name].append({**json.loads(line[0][7:]), **replica_steps(proc.stderr)})
            r = results[name][-1]
            gen = f", generate {r['generate_s']:.1f} s, {r['tokens_per_s']:.1f} tok/s" if "generate_s" in r else ""
            print(f"rep {rep} {name}: {r['tokens']} tokens{gen}"
                  + (f", wall {r['wall_s']:.1f} s ({r['end_to_end_tokens_per_s']:.1f} tok/s end to end)"
                     if "wall_s" in r else ""), flush=True)
    reference = next(iter(results.values()))[0]["outputs"]
    summary = {"n_prompts": len(rows), "max_tokens": args.max_tokens, "batch": args.batch,
               "rows_per_unit": args.rows_per_unit, "repeats": args.repeats, "model": MODEL, "configs": {}}
    for name, runs in results.items():
        entry = {k: spread([r[k] for r in runs]) for k in runs[0] if k != "outputs" and k != "rows"}
        entry["identical_to_engine"] = sum(r["outputs"] == reference for r in runs) / len(runs)
        summary["configs"][name] = entry
    c = summary["configs"]
    for t in ("1t", "2t"):
        if {f"processor-1r-{t}", f"job-1w-{t}"} <= set(c):
            for k in ("end_to_end_tokens_per_s", "tokens_per_s"):
                summary[f"processor_vs_job_{k}_1w_{t}"] = (c[f"processor-1r-{t}"][k]["median"]
                                                          / c[f"job-1w-{t}"][k]["median"])
    if set(c) != set(CONFIGS):
        return _write(args, summary)
    summary["overhead_1w_2t"] = c["job-1w-2t"]["generate_s"]["median"] / c["engine-2t"]["generate_s"]["median"] - 1
    summary["overhead_1w_1t"] = c["job-1w-1t"]["generate_s"]["median"] / c["engine-1t"]["generate_s"]["median"] - 1
    summary["scaling_2w_vs_1w_1t"] = c["job-1w-1t"]["generate_s"]["median"] / c["job-2w-1t"]["generate_s"]["median"]
    _write(args, summary)


def _write(args, summary: dict) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "configs"}, indent=2))


def _passthrough(args) -> list[str]:
    return ["--n", str(args.n), "--max-tokens", str(args.max_tokens), "--batch", str(args.batch),
            "--rows-per-unit", str(args.rows_per_unit), "--shards", args.shards, "--work", args.work]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", action="store_true")
    p.add_argument("--one", choices=sorted(CONFIGS))
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), help="a subset (default: all)")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rows-per-unit", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shards", default=str(ROOT / "bench" / "out" / "pipeline_in"))
    p.add_argument("--work", default=str(ROOT / "bench" / "out"))
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "pipeline.json"))
    args = p.parse_args()
    one(args) if args.one else suite(args)


if __name__ == "__main__":
    main()
