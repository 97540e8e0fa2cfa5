"""The Ray token files we create or use are private to their user: 0600 in a 0700 folder, for the
job's own local Ray (driver.secure_local_token) and for infra/start_local_cluster.sh. Ray's
own writer leaves ~/.ray/auth_token 0644 in a 0755 folder, where any local user could take the cluster."""
import os
import subprocess

import pytest

from pipeline.cluster.driver import secure_local_token


def _modes(home):
    token = home / ".ray" / "auth_token"
    return token.stat().st_mode & 0o777, token.parent.stat().st_mode & 0o777


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    return tmp_path


def _loose_token(home) -> str:
    (home / ".ray").mkdir(mode=0o755)
    os.chmod(home / ".ray", 0o755)
    (home / ".ray" / "auth_token").write_text("existing-token")
    os.chmod(home / ".ray" / "auth_token", 0o644)
    return "existing-token"


def test_job_local_ray_token_is_created_private(home):
    secure_local_token()
    assert _modes(home) == (0o600, 0o700)
    assert len((home / ".ray" / "auth_token").read_text()) == 64


def test_job_local_ray_tightens_an_existing_token(home):
    before = _loose_token(home)
    secure_local_token()
    assert _modes(home) == (0o600, 0o700)
    assert (home / ".ray" / "auth_token").read_text() == before      # kept: clusters may use it


@pytest.mark.parametrize("existing", [False, True], ids=["fresh", "existing-0644"])
def test_start_local_cluster_token_is_private(existing, home):
    before = _loose_token(home) if existing else None
    subprocess.run(["bash", "infra/start_local_cluster.sh", "--token-only"], check=True, env=os.environ.copy(),
                   capture_output=True, timeout=60)
    assert _modes(home) == (0o600, 0o700)
    if before is not None:
        assert (home / ".ray" / "auth_token").read_text() == before
