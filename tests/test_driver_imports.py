"""What a driver imports: the job's, the synthetic job's and a Ray Data pipeline's driver read configs,
plan work and start actors, and never load torch, transformers or llguidance themselves (about 4 s and
several hundred MB on two cores; llguidance only to check a job-wide response_format); the workers and
replicas load them with the model. Each check runs a
fresh interpreter, so modules other tests imported do not hide an import."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ["torch", "transformers", "llguidance"]
DRIVERS = ["pipeline.cluster.driver", "pipeline.cli", "pipeline.report.summary", "pipeline.processor",
           "pipeline.synthetic.job", "pipeline.synthetic.plan"]


def loaded_after(code: str) -> list[str]:
    probe = f"import json, sys\n{code}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_drivers_import_no_torch():
    imports = "\n".join(f"import {m}" for m in DRIVERS)
    assert loaded_after(imports) == []


@pytest.mark.parametrize("code", [
    # a job config and a processor config, built as the drivers build them (no response_format)
    "from pipeline.job.config import load_config; load_config('configs/demo.yaml', [])",
    "from pipeline.processor import SpecpipeProcessorConfig, build_processor\n"
    "build_processor(SpecpipeProcessorConfig(models={'target': 'smollm2-135m-instruct'}, sampling={'max_tokens': 8}))",
])
def test_driver_configs_import_no_torch(code):
    assert loaded_after(code) == []


def test_a_job_wide_response_format_is_checked_without_torch():
    """The driver compiles a job-wide format (llguidance) to refuse a bad one before any actor starts;
    the grammar library's torch is the workers' (masks), not the check's."""
    code = ("from pipeline.job.config import load_config\n"
            "load_config('configs/demo.yaml', ['sampling.response_format={type: json_object}'])")
    assert loaded_after(code) == ["llguidance"]


def test_the_probe_sees_an_import():
    """The check can fail: the engine's step does load torch."""
    assert "torch" in loaded_after("import pipeline.engine.engine")
