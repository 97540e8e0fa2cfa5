"""What the benchmarks share: the models they run, one configuration of ours in a fresh process, the
vLLM peer's command line, the median / min / max of repeated runs, and reading prompt and result files.

Prompt files are JSON lists of token-id lists (chat template applied, bench.make_prompts); result
files are one run's JSON (bench.run_one, bench/vllm_runner.py), its texts under "outputs".
This module imports neither torch nor our engine: a script's `--help` stays quick.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / "bench/.venv-vllm/bin/python"     # bench/setup_vllm.sh makes it
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
MODELS = {   # name -> (target, draft)
    "smollm2": ("smollm2-135m-instruct", None),
    "qwen": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
}


def load_json(path) -> dict | list:
    with open(path) as f:
        return json.load(f)


def load_prompts(path, n: int | None = None) -> list[list[int]]:
    """The first n prompts (all with None) of a token-id prompt file."""
    return load_json(path)[:n]


def load_texts(run, prompts) -> tuple[list[list[int]], list[list[int]]]:
    """A run's recorded outputs and the prompts they follow (the prompt file's first as many)."""
    outputs = load_json(run)["outputs"]
    return load_prompts(prompts, len(outputs)), outputs


def spread(values: list[float]) -> dict[str, float]:
    """The median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_json(cmd: list[str], out: Path, env: dict[str, str] | None = None) -> dict:
    """Runs `cmd` from the repository root (`env` added to ours) and reads the JSON it wrote to `out`,
    with the process's wall time as process_s; {"error", "cmd"} when it fails."""
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:], "cmd": " ".join(cmd)}
    res = load_json(out)
    res["process_s"] = time.time() - t0
    return res


def run_config(cfg: dict, model: str, prompts_file: Path, out: Path, common: list[str]) -> dict:
    """One configuration of ours (bench.run_one with cfg["args"] after `common`) in a fresh process."""
    cmd = [sys.executable, "-m", "bench.run_one", "--model", model, "--prompts", str(prompts_file),
           "--out", str(out), *common, *cfg["args"]]
    return run_json(cmd, out)


def run_vllm_runner(model_dir: Path, prompts_file: Path, out: Path, *, mode: str, batch: str, max_tokens: int,
                    dtype: str, n_b1: int, repeats: int, extra: list[str] = ()) -> dict:
    """vLLM's CPU build in its own venv (bench/vllm_runner.py, one load, `repeats` timed runs of each
    batch setting) on cores 0-1, scheduling at most 4096 tokens a step; `extra`: more runner flags."""
    cmd = [str(VLLM_PY), str(ROOT / "bench/vllm_runner.py"), "--model-dir", str(model_dir),
           "--prompts-json", str(prompts_file), "--max-tokens", str(max_tokens), "--dtype", dtype,
           "--mode", mode, "--batch", batch, "--n-b1", str(n_b1), "--repeats", str(repeats),
           "--max-num-batched-tokens", "4096", *extra, "--out", str(out)]
    return run_json(cmd, out, VLLM_ENV)


class ReadyWatch:
    """When the first actor whose class names `needle` is ALIVE (its __init__, the model load, done),
    read from the GCS every 0.25 s."""

    def __init__(self, needle: str, t0: float):
        self.needle, self.t0, self.ready_s = needle, t0, None
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        from ray._private import state
        while self.ready_s is None:
            try:
                for a in state.actors().values():
                    if a.get("State") == "ALIVE" and self.needle in str(a.get("ActorClassName", "")) + str(
                            a.get("Name", "")) + str(a.get("ReprName", "")):
                        self.ready_s = time.time() - self.t0
            except Exception:  # noqa: BLE001 -- the GCS not up yet
                pass
            time.sleep(0.25)
