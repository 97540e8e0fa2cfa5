"""The product's files speak of the product: no work-period labels, issue numbers or change history
in code, docs, tests, configs or infra (history lives in git). Ray's own `SessionName` and
`start_new_session` are words of the product's world and do not match."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = re.compile("|".join([
    r"\bsessions? [0-9]",                 # 'Session' and a number
    r"\bissues? #?[0-9]",                 # an issue by number
    r"\bbefore this change\b",
]), re.IGNORECASE)


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return [ROOT / f for f in out if (ROOT / f).is_file() and not f.endswith((".parquet", ".gz", ".png"))]


def offending_lines(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    return found


def test_the_product_names_no_work_periods_or_issue_numbers():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    assert offending_lines(tracked_text_files()) == []


N = 12      # the examples are assembled here, so that this file itself matches none


@pytest.mark.parametrize("line, bad", [
    (f"measured in Session {N} on the AVX2 box", True), (f"see issue {N}, item 2", True),
    (f"sessions {N}-{N + 1} had AVX-512", True), ("slower than before " + "this change", True),
    ("ray.util.state SessionName of the head", False), ("Popen(..., start_new_session=True)", False),
    ("a session token for the Ray head", False),
])
def test_the_check_catches_what_it_guards(tmp_path, line, bad):
    path = tmp_path / "f.py"
    path.write_text(f"x = 1\n# {line}\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert bool(offending_lines([path])) == bad
    finally:
        ROOT = root
