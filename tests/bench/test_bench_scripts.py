"""Every benchmark script still starts: its `--help` prints the usage and exits 0, a maintained script's `--tiny` dry run
(where it has one) finishes, each shell script parses (`bash -n`) and each library imports. Nothing
here measures anything or needs a model checkpoint.

The `--help` runs share one child interpreter: each script runs there as `python -m` runs it
(runpy, as __main__, from the repository root), so torch and the engine are imported once rather
than once a script (3-6 s each on two cores). The dry runs get a process each."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAINTAINED = ["bench", "run_one", "make_prompts", "make_templated", "prompts", "structured", "structured_bench",
              "drafter_workloads", "tree_bench", "pipeline_bench", "reader_memory", "step_bench", "linear_kernels",
              "start_cost", "gpu_bench", "vllm_runner", "tp_bench", "synthetic_bench", "near_dup_bench", "raydata_llm_bench"]
RESEARCH = ["attention_kernel", "draft_rounds", "drafter_sim", "gpu_profile", "grammar_backends", "linear_plans",
            "read_bandwidth", "step_split", "suffix_lookup", "topk_replay", "tree_replay", "tree_step", "allreduce", "engine_ab"]
SCRIPTS = MAINTAINED + [f"research.{name}" for name in RESEARCH]
LIBRARIES = ["common", "hf_baselines", "prompts"]          # imported by the scripts
SHELL = ["gpu_check.sh", "setup_vllm.sh", "research/alternating.sh", "research/ab_commits.sh"]
TINY = {   # maintained script -> its dry run's arguments (research probes are rerun by hand: --help only)
    "gpu_bench": ["--device", "cpu", "--dtype", "float32", "--tiny", "--config-s", "1"],   # every part, 1 s each
}

_HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback
results = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    text, code = io.StringIO(), 0
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            code = stop.code or 0
        except BaseException:
            code = traceback.format_exc()
    results[name] = [code, text.getvalue()]
print(json.dumps(results))
"""


def _env() -> dict[str, str]:
    """Ours without $OUT: the GPU scripts write their logs there when it is set."""
    return {k: v for k, v in os.environ.items() if k != "OUT"}


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[int | str, str]]:
    """script -> (exit code or traceback, what its --help printed)."""
    proc = subprocess.run([sys.executable, "-c", _HELP_ALL, *(f"bench.{s}" for s in SCRIPTS)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name.removeprefix("bench."): tuple(r) for name, r in json.loads(proc.stdout.splitlines()[-1]).items()}


def test_every_script_is_listed():
    found = {p.stem for p in (ROOT / "bench").glob("*.py")} | {f"research.{p.stem}"
                                                               for p in (ROOT / "bench/research").glob("*.py")}
    assert found - {"__init__", "research.__init__"} == set(SCRIPTS) | set(LIBRARIES)
    shells = [*(ROOT / "bench").glob("*.sh"), *(ROOT / "bench/research").glob("*.sh")]
    assert {str(p.relative_to(ROOT / "bench")) for p in shells} == set(SHELL)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(helps, script):
    code, text = helps[script]
    assert code == 0, f"{code}\n{text[-3000:]}"
    assert "usage:" in text and "-h, --help" in text, text[-3000:]
    if script in MAINTAINED:
        assert ("--tiny" in text) == (script in TINY), "a maintained script's --tiny dry run belongs in TINY"


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s == "gpu_bench" else s for s in TINY])
def test_tiny_dry_run(tmp_path, script):
    extra = ["--out", str(tmp_path / "out.json")] if script == "gpu_bench" else []
    proc = subprocess.run([sys.executable, "-m", f"bench.{script}", *TINY[script], *extra], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    if script == "gpu_bench":   # every part ran on every tiny model: a failing run is reported, not raised
        report = json.loads((tmp_path / "out.json").read_text())
        failed = [r for m in report["models"] for runs in ("configs", "hf", "profiles") for r in m[runs]
                  if "error" in r]
        assert not failed and not report["skipped"], failed or report["skipped"]
        assert [r["model"] for r in report["b1_vs_hf"]] == [m["model"] for m in report["models"]]
        assert report["models"][-1]["profiles"]


@pytest.mark.parametrize("script", SHELL)
def test_shell_parses(script):
    proc = subprocess.run(["bash", "-n", str(ROOT / "bench" / script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("library", LIBRARIES)
def test_library_imports(library):
    __import__(f"bench.{library}")


def test_drafter_sim_replays_the_suffix_walk(tmp_path, capsys, monkeypatch):
    """The suffix drafter's lookup answers a Walk: the replay drafts its tokens and, on a text that
    repeats, has some accepted (more than one token a round)."""
    from bench.research import drafter_sim
    motif = [11, 12, 13, 14, 15, 16]
    prompts, outputs = [[1, 2, 3] + motif] * 3, [motif * 4] * 3
    (tmp_path / "prompts.json").write_text(json.dumps(prompts + [[9]]))      # longer than the run: cut to it
    (tmp_path / "run.json").write_text(json.dumps({"outputs": outputs}))
    monkeypatch.setattr(sys, "argv", ["drafter_sim", "--run", str(tmp_path / "run.json"), "--prompts",
                                      str(tmp_path / "prompts.json"), "--batch", "2", "--ngram", "--suffix", "{}"])
    drafter_sim.main()
    lines = {line.split("  ")[0].strip(): line for line in capsys.readouterr().out.splitlines()}
    assert set(lines) == {"ngram", "suffix {}"}
    for line in lines.values():
        assert float(line.split("tokens/round")[1].split()[0]) > 1.5, line


@pytest.mark.slow
def test_the_gpu_checks_tensor_parallel_part_dry_runs_on_cpu(tmp_path):
    """gpu_check.sh's tensor-parallel part, as its CPU dry run (gloo, a tiny random-init model saved as
    safetensors): 2 ranks run and write the tokens of 1 (fp32), each rank holding less than the whole."""
    args = ["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--batches", "4", "--max-tokens", "8",
            "--repeats", "1", "--out", str(tmp_path / "tp.json")]
    proc = subprocess.run([sys.executable, "-m", "bench.tp_bench", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((tmp_path / "tp.json").read_text())["summary"]
    assert set(summary) == {"1/4", "2/4"}
    assert all(s["same_outputs"] for s in summary.values())
    assert max(summary["2/4"]["weight_bytes"].values()) < summary["1/4"]["weight_bytes"]["0"]
    assert summary["2/4"]["collective_share"]["all-reduce"] > 0
