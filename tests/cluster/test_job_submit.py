"""The batch job as it runs in production: `ray job submit --working-dir <repo>` to a real
`ray start --head` (loopback, token auth), the job joining that cluster through RAY_ADDRESS.

Covers: what the working-dir upload holds; token auth on the job API; a bad config failing the
submission and naming the key; a job over two Parquet shards committing every row exactly once.
"""
from __future__ import annotations

import pytest
import json
import os
import secrets
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from pipeline_util import job_overrides, manifest, prompt_rows, read_run, write_parquet

REPO = Path(__file__).resolve().parents[2]
SUBMIT_TIMEOUT = 300     # the job takes ~20-30 s here; a driver that cannot reach its GCS retries ~10 min


def session_token() -> str:
    return Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text().strip()


def api_get(head, path: str, token: str | None) -> tuple[int, str]:
    """GET on the head's dashboard/job API; `token=None` sends no credentials at all."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(f"{head.dashboard_url}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def submit(head, submission_id: str, overrides: list[str]) -> subprocess.CompletedProcess:
    """`ray job submit` (waits for the job, streams its output) of the demo job with overrides."""
    cmd = [head.ray, "job", "submit", "--address", head.dashboard_url, "--submission-id", submission_id,
           "--working-dir", str(REPO), "--", "python", "jobs/generate.py", "--config", "configs/demo.yaml",
           *overrides]
    return subprocess.run(cmd, env=head.env, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT)


def job_info(head, submission_id: str) -> dict:
    status, body = api_get(head, f"/api/jobs/{submission_id}", session_token())
    assert status == 200, body
    return json.loads(body)


def test_working_dir_upload_excludes_environments_and_outputs():
    """What `ray job submit --working-dir <repo>` would zip, walked by Ray's own packager traversal
    with and without .gitignore honoured (RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1) and without Ray's
    default excludes (.git, .venv, __pycache__: only Ray >= 2.60 has them): code and configs only, far
    below the job API's 100 MiB upload limit. The walk stops early if an environment gets in."""
    from ray._private.runtime_env.packaging import _dir_travel

    for include_gitignore in (True, False):
        seen: list[Path] = []

        def collect(path: Path) -> None:
            seen.append(path)
            if len(seen) > 2000:
                raise RuntimeError(f"upload would hold > 2000 paths, e.g. {path}")

        _dir_travel(REPO, [], collect, include_gitignore=include_gitignore)
        names = {p.relative_to(REPO).as_posix() for p in seen if p.is_file()}   # what the zip holds
        assert {"jobs/generate.py", "configs/demo.yaml", "pipeline/cluster/driver.py"} <= names
        for banned in (".venv", "bench/.venv-vllm", "out", ".git"):
            assert not any(n.startswith(banned + "/") for n in names), (include_gitignore, banned)
        assert not any("__pycache__" in n for n in names)
        size = sum(p.stat().st_size for p in seen if p.is_file())
        assert size < 10 * 1024 ** 2, (include_gitignore, size)


def test_job_api_requires_the_token(ray_head, tmp_path):
    token = session_token()
    # Raw HTTP: no credentials -> 401, a wrong token -> 403, the session token -> 200.
    assert api_get(ray_head, "/api/jobs/", None)[0] == 401
    assert api_get(ray_head, "/api/jobs/", secrets.token_hex(32))[0] == 403
    status, body = api_get(ray_head, "/api/jobs/", token)
    assert status == 200 and isinstance(json.loads(body), list)

    # The CLI: a wrong token (in both the variable and the token file) is refused; the right one works.
    wrong = tmp_path / "wrong_token"
    wrong.write_text(secrets.token_hex(32))
    cmd = [ray_head.ray, "job", "list", "--address", ray_head.dashboard_url]
    bad_env = {**ray_head.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": wrong.read_text(),
               "RAY_AUTH_TOKEN_PATH": str(wrong)}
    refused = subprocess.run(cmd, env=bad_env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "403" in refused.stdout + refused.stderr or "invalid" in (refused.stdout + refused.stderr).lower()
    allowed = subprocess.run(cmd, env=ray_head.env, capture_output=True, text=True, timeout=120)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


@pytest.mark.slow
def test_submitted_bad_config_fails_naming_the_key(ray_head, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in" / "a.parquet", prompt_rows(4, "a"))
    out = tmp_path / "out"
    sid = f"specpipe-badcfg-{uuid.uuid4().hex[:8]}"
    result = submit(ray_head, sid, job_overrides(tiny_model_dir, str(src.parent), str(out),
                                                 "engine.max_num_seqs=0"))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "engine.max_num_seqs" in output, output
    info = job_info(ray_head, sid)
    assert info["status"] == "FAILED", info
    assert "exit code 2" in (info.get("message") or ""), info      # the config check, not a crash
    assert not out.exists() or not any(out.iterdir())               # failed before any output


def test_submitted_job_commits_every_row_once(ray_head, tiny_model_dir, tmp_path):
    rows_a, rows_b = prompt_rows(7, "a"), prompt_rows(6, "b", seed=3)
    write_parquet(tmp_path / "in" / "a.parquet", rows_a, row_group_size=4)
    write_parquet(tmp_path / "in" / "b.parquet", rows_b, row_group_size=4)
    out = tmp_path / "out"
    sid = f"specpipe-ok-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    result = submit(ray_head, sid, job_overrides(tiny_model_dir, str(tmp_path / "in"), str(out)))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    info = job_info(ray_head, sid)
    assert info["status"] == "SUCCEEDED", info

    run_dir = out / "t"
    assert (run_dir / "_SUCCESS").exists() and (run_dir / "manifest.json").exists()
    tables = read_run(run_dir)
    ids = [c["id"] for c in tables["completions"]]
    assert sorted(ids) == sorted(r["id"] for r in rows_a + rows_b)   # every input id exactly once
    assert tables["errors"] == []
    m = manifest(run_dir)
    assert m["units"] == 4 and m["completions"] == 13 and m["errors"] == 0          # 2 + 2 units of <= 5
    assert all(Path(f).exists() for f in m["files"]["completions"])
    assert all(0 < len(c["token_ids"]) <= 8 and c["text"] for c in tables["completions"])
    assert {Path(c["source_file"]).name for c in tables["completions"]} == {"a.parquet", "b.parquet"}

    # The job ran on this head (RAY_ADDRESS), not on a local Ray the driver started for itself: the
    # head's state API lists this job's generation worker actors.
    status, body = api_get(ray_head, "/api/v0/actors?limit=1000&detail=1", session_token())
    assert status == 200, body
    actors = json.loads(body)["data"]["result"]["result"]
    workers = [a for a in actors
               if a.get("class_name") == "GenerationWorker" and a.get("job_id") == info["job_id"]]
    assert len(workers) >= 2, [(a.get("class_name"), a.get("job_id")) for a in actors]
    print(f"submitted job: {time.perf_counter() - t0:.1f} s")
