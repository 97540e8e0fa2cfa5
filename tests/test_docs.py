"""The docs against their sources: the README's results section quotes only figures that
bench/RESULTS.md holds (RESULTS keeps the current figure per topic, with its machine and command),
and both files stay within their size budgets."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README, RESULTS = ROOT / "README.md", ROOT / "bench" / "RESULTS.md"
BUDGET = {README: 350, RESULTS: 465}
# a figure: a decimal (34.2, 1.55x), or a whole number of three or more digits (4549); not in a link or a commit
FIGURE = re.compile(r"(?<![\w.#/-])(\d+\.\d+|\d{3,})(?![0-9A-Za-wyz_/-]|\.\d)")   # "x": a ratio


def section(text: str, title: str) -> str:
    """The text of the `## title` section, up to the next `## ` heading."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def figures(text: str) -> set[str]:
    text = re.sub(r"\]\([^)]*\)", "]", text)             # link targets name anchors, not figures
    return set(FIGURE.findall(text))


def test_every_figure_in_the_readme_results_is_in_results():
    quoted = figures(section(README.read_text(), "Results"))
    assert len(quoted) > 20, "the check found too few figures to mean anything"
    held = RESULTS.read_text()
    missing = sorted(f for f in quoted if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", held))
    assert missing == [], "README figures not in bench/RESULTS.md"


def test_the_check_sees_a_figure_results_does_not_hold():
    assert figures("ours 123.45 tok/s, 9.99x, 4321 rows, [link](bench/RESULTS.md#gpu-2)") == {"123.45", "9.99", "4321"}


def test_docs_within_their_line_budgets():
    sizes = {path.name: len(path.read_text().splitlines()) for path in BUDGET}
    assert all(sizes[path.name] <= limit for path, limit in BUDGET.items()), sizes
