"""Ray Data LLM's vLLM processor beside our processor and our job: the same rows, one run.

    bash bench/setup_vllm.sh        # bench/.venv-vllm: vLLM's CPU build + Ray Data LLM at our Ray version
    .venv/bin/python -m bench.raydata_llm_bench --n 64 --max-tokens 128 --repeats 3 --dtype float32 \
        --out bench/out/raydata_llm_float32.json

Arms (each run a fresh process; the arms alternate within every repeat, so drift hits them alike):
  rdllm-plain    Ray Data LLM: `ray.data.llm.build_processor(vLLMEngineProcessorConfig(...))` on vLLM's
                 CPU build (bench/.venv-vllm), no speculation
  rdllm-ngram    the same with vLLM's n-gram speculation through engine_kwargs (speculative_config:
                 method ngram, 4 tokens, lookup 2..4: our n-gram drafter's settings)
  ours-plain     our processor (pipeline/processor), drafting.method=none
  ours-default   our processor with the default drafting (adaptive n-gram)
  job            jobs/generate.py's run_job on the same rows (default drafting), committed to local disk

Every processor arm: a local Ray of --ray-cpus logical CPUs, read_parquet -> processor -> write_parquet;
the replica gets 2 CPUs (vLLM: a placement bundle {"CPU": 2}, its OpenMP threads bound to cores 0-1;
ours: num_cpus=2). Each system keeps its own defaults (batch_size: Ray Data LLM 32, ours 64; vLLM's
max_num_seqs, our engine's auto) except what a 2-core CPU node needs: Ray Data LLM's chat-template,
tokenize and detokenize stages and both processors' pre/postprocess maps at 0.25 CPU (at 1 CPU each
they never schedule beside the replica) and its engine placed by a CPU bundle (its default asks a GPU).
vLLM's KV cache: --kv-cache-gb.

Reported per arm, median [min, max] over the repeats:
  wall_s / rows_per_s / tokens_per_s   from the arm's first import (Ray, the pipeline) to the last row
              written (load included)
  ready_s     when the replica's actor is ALIVE (its model loaded), from the same start; the job: wall
              minus its generate time (first worker ready -> last unit committed)
  steady_tokens_per_s   tokens / (wall - ready): generation with the pipeline around it, without the load
  peak_pss_mb  the most memory (PSS, so the object store's shared pages count once) of the arm's process
               tree at once: the driver, Ray's processes, the replica, vLLM's engine process
  identical    of the rows, the fraction whose tokens equal ours-plain's (greedy: exact systems agree in
               fp32 up to kernels' rounding)
Nothing else may run on the machine meanwhile (2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import ReadyWatch  # noqa: E402 -- after the path, as the arms run this file directly

VLLM_PY = ROOT / "bench" / ".venv-vllm" / "bin" / "python"
MODEL = "smollm2-135m-instruct"
ARMS = ("rdllm-plain", "rdllm-ngram", "ours-plain", "ours-default", "job")
SMALL = {"num_cpus": 0.25}
REPLICA_CPUS = 2


# ---- one arm, in its own process ------------------------------------------------------------------
def stamp(row: dict) -> dict:
    """Postprocess of both processors: the columns compared, and when the row came out."""
    return {"id": row["id"], "generated_tokens": [int(t) for t in row["generated_tokens"]],
            "num_generated_tokens": int(row["num_generated_tokens"] or 0), "t": time.time()}


def read_output(folder: Path) -> list[dict]:
    import pyarrow.parquet as pq
    return [r for f in sorted(folder.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def summarize(rows: list[dict], t0: float, ready_s: float | None) -> dict:
    wall = max(r["t"] for r in rows) - t0
    tokens = sum(r["num_generated_tokens"] for r in rows)
    return {"rows": len(rows), "tokens": tokens, "wall_s": wall, "rows_per_s": len(rows) / wall,
            "tokens_per_s": tokens / wall, "ready_s": ready_s,
            "steady_tokens_per_s": tokens / (wall - ready_s) if ready_s else None,
            "outputs": {r["id"]: r["generated_tokens"] for r in rows}}


def run_rdllm(args, out: Path) -> dict:
    """Ray Data LLM's vLLM processor (in bench/.venv-vllm: imports nothing of ours)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gb), "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    os.environ.update(env)
    t0 = time.time()
    import ray
    import ray.data
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig
    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, runtime_env={"env_vars": env},
             logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    watch = ReadyWatch("vLLMEngineStageUDF", t0)
    engine_kwargs = {"dtype": args.dtype, "max_model_len": 1024, "seed": 0}
    if args.one == "rdllm-ngram":
        engine_kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 4,
                                               "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if args.rdllm_batch:
        engine_kwargs["max_num_seqs"] = args.rdllm_batch
    config = vLLMEngineProcessorConfig(
        model_source=args.model_dir, engine_kwargs=engine_kwargs, concurrency=1,
        **({"batch_size": args.rdllm_batch} if args.rdllm_batch else {}),
        runtime_env={"env_vars": env}, placement_group_config={"bundles": [{"CPU": REPLICA_CPUS}]},
        chat_template_stage=SMALL, tokenize_stage=SMALL, detokenize_stage=SMALL)
    max_tokens = args.max_tokens
    processor = build_processor(
        config, preprocess=lambda row: {"id": row["id"], "messages": row["messages"],
                                        "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens}},
        postprocess=stamp, preprocess_map_kwargs=SMALL, postprocess_map_kwargs=SMALL)
    processor(ray.data.read_parquet(args.shards)).write_parquet(str(out))
    ray.shutdown()
    return summarize(read_output(out), t0, watch.ready_s)


def run_ours(args, out: Path) -> dict:
    t0 = time.time()
    import ray
    import ray.data

    from pipeline.cluster.driver import connect
    from pipeline.job.config import ClusterConfig
    from pipeline.processor import SpecpipeProcessorConfig, build_processor
    connect(ClusterConfig(), args.ray_cpus)
    ray.data.DataContext.get_current().enable_progress_bars = False
    watch = ReadyWatch("SpecpipeStage", t0)
    drafting = {"method": "none"} if args.one == "ours-plain" else {}
    config = SpecpipeProcessorConfig(
        models={"target": MODEL, "dtype": args.dtype}, drafting=drafting,
        sampling={"max_tokens": args.max_tokens, "temperature": 0.0}, concurrency=1, num_cpus=REPLICA_CPUS,
        id_column="id", **({"batch_size": args.ours_batch} if args.ours_batch else {}))
    processor = build_processor(config, postprocess=stamp, postprocess_map_kwargs=SMALL)
    processor(ray.data.read_parquet(args.shards)).write_parquet(str(out))
    ray.shutdown()
    rows = read_output(out)
    if any(r["num_generated_tokens"] == 0 for r in rows):
        raise SystemExit("rows without tokens: the processor answered some with an error")
    return summarize(rows, t0, watch.ready_s)


def run_job(args, out: Path) -> dict:
    t0 = time.time()                  # before the imports, as the processor arms' start
    import pyarrow.parquet as pq

    from pipeline.cluster.driver import run_job as run
    from pipeline.job.config import load_config
    s = run(load_config(None, [
        f"models.target={MODEL}", f"models.dtype={args.dtype}", f"sampling.max_tokens={args.max_tokens}",
        "sampling.temperature=0", f"input.path={args.shards}", f"output.path={out}", "run.run_id=bench",
        "run.progress=false", "cluster.num_workers=1", f"cluster.num_cpus_per_worker={REPLICA_CPUS}"]))
    wall = time.time() - t0
    comps = [r for f in sorted((out / "bench" / "completions").glob("*.parquet"))
             for r in pq.read_table(f, columns=["id", "token_ids"]).to_pylist()]
    return {"rows": s["rows"], "tokens": s["tokens"], "wall_s": wall, "rows_per_s": s["rows"] / wall,
            "tokens_per_s": s["tokens"] / wall, "ready_s": wall - s["generate_s"],   # all but generating
            "steady_tokens_per_s": s["tokens"] / s["generate_s"],
            "outputs": {c["id"]: c["token_ids"] for c in comps}}


def one(args) -> None:
    out = Path(args.work) / f"{args.one}-{os.getpid()}"
    shutil.rmtree(out, ignore_errors=True)
    run = run_rdllm if args.one.startswith("rdllm") else run_job if args.one == "job" else run_ours
    result = run(args, out)
    shutil.rmtree(out, ignore_errors=True)
    print("RESULT " + json.dumps(result), flush=True)


# ---- the suite: arms alternating, memory sampled from outside -----------------------------------
def tree_pss_mb(root_pid: int) -> float:
    """PSS of root_pid and all its descendants, MiB."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def run_arm(name: str, args) -> dict:
    python = str(VLLM_PY) if name.startswith("rdllm") else sys.executable
    cmd = [python, str(ROOT / "bench" / "raydata_llm_bench.py"), "--one", name, *passthrough(args)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    log_path = Path(args.work) / f"{name}.log"
    with open(log_path, "w") as log:      # a file, not a pipe: Ray forwards every worker's output here
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        peak = 0.0
        while proc.poll() is None:
            peak = max(peak, tree_pss_mb(proc.pid))
            time.sleep(1.0)
    line = [l for l in log_path.read_text(errors="replace").splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not line:
        raise SystemExit(f"{name} failed (rc {proc.returncode}): see {log_path}")
    return {**json.loads(line[0][7:]), "peak_pss_mb": peak}


def suite(args) -> None:
    from bench.common import spread
    from bench.pipeline_bench import write_shards
    from pipeline.loading.models import resolve_hf_dir
    if not VLLM_PY.exists():
        raise SystemExit("bench/.venv-vllm missing: run bash bench/setup_vllm.sh")
    shutil.rmtree(args.shards, ignore_errors=True)
    write_shards(args.n, Path(args.shards))
    args.model_dir = str(resolve_hf_dir(MODEL))
    Path(args.work).mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name in args.arms}
    for rep in range(args.repeats):
        for name in args.arms:
            r = run_arm(name, args)
            results[name].append(r)
            print(f"rep {rep} {name}: {r['tokens']} tokens, wall {r['wall_s']:.1f} s ({r['tokens_per_s']:.1f} tok/s), "
                  f"ready {r['ready_s'] or float('nan'):.1f} s, steady {r['steady_tokens_per_s'] or float('nan'):.1f} "
                  f"tok/s, peak {r['peak_pss_mb']:.0f} MiB", flush=True)
    ref = results.get("ours-plain", next(iter(results.values())))[0]["outputs"]
    summary = {"n_rows": args.n, "max_tokens": args.max_tokens, "dtype": args.dtype, "repeats": args.repeats,
               "ray_cpus": args.ray_cpus, "model": MODEL, "arms": {}}
    for name, runs in results.items():
        entry = {k: spread([r[k] for r in runs]) for k in runs[0]
                 if k not in ("outputs", "rows") and all(r[k] is not None for r in runs)}
        same = [sum(r["outputs"].get(i) == toks for i, toks in ref.items()) / len(ref) for r in runs]
        entry["identical_to_ours_plain"] = spread(same)
        summary["arms"][name] = entry
    a = summary["arms"]
    for ours, theirs in (("ours-default", "rdllm-plain"), ("ours-default", "rdllm-ngram"),
                         ("ours-plain", "rdllm-plain"), ("ours-default", "job")):
        if ours in a and theirs in a:
            for k in ("tokens_per_s", "steady_tokens_per_s"):
                if k in a[ours] and k in a[theirs]:
                    summary[f"{ours}_vs_{theirs}_{k}"] = a[ours][k]["median"] / a[theirs][k]["median"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "arms"}, indent=2))


def passthrough(args) -> list[str]:
    return ["--n", str(args.n), "--max-tokens", str(args.max_tokens), "--dtype", args.dtype, "--shards", args.shards,
            "--work", args.work, "--ray-cpus", str(args.ray_cpus), "--kv-cache-gb", str(args.kv_cache_gb),
            "--model-dir", args.model_dir, "--rdllm-batch", str(args.rdllm_batch), "--ours-batch", str(args.ours_batch)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", choices=ARMS, help="run one arm in this process (the suite's child)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--n", type=int, default=64, help="rows (bench/prompts.py's mixed set)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 (both systems alike)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ray-cpus", type=int, default=4, help="the local Ray's logical CPUs (2 cores here)")
    p.add_argument("--kv-cache-gb", type=int, default=4, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--rdllm-batch", type=int, default=0, help="Ray Data LLM batch_size and max_num_seqs (0: its defaults)")
    p.add_argument("--ours-batch", type=int, default=0, help="our processor's batch_size (0: its default)")
    p.add_argument("--model-dir", default="", help="(set by the suite) the model's safetensors folder")
    p.add_argument("--shards", default=str(ROOT / "bench" / "out" / "raydata_llm_in"))
    p.add_argument("--work", default=str(ROOT / "bench" / "out" / "raydata_llm_work"))
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "raydata_llm.json"))
    args = p.parse_args()
    one(args) if args.one else suite(args)


if __name__ == "__main__":
    main()
