"""The README's config reference and the config dataclasses name the same keys with the same
defaults: a key added, renamed or re-defaulted in code without the README (or the other way) fails.
`debug.*` (failure drills for the tests) has no rows."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from pipeline.job.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| (`[a-z_]+\.[a-z_.]+`(?:, `[a-z_]+`)*) \| ([^|]*) \|")


def config_keys(cls=JobConfig, prefix: str = "") -> dict[str, object]:
    """Every leaf key of the config tree with its default (nested dataclasses flattened)."""
    keys = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            keys.update(config_keys(type(default), f"{prefix}{f.name}."))
        else:
            keys[f"{prefix}{f.name}"] = default
    return keys


def readme_rows(text: str) -> dict[str, str]:
    """key -> default. A row may name sibling keys (`a.b`, `c`: a.b and a.c) with one default each, in
    order, or one default for all of them."""
    rows = {}
    for m in filter(None, map(ROW.match, text.splitlines())):
        names = [n.strip("`") for n in m.group(1).split(", ")]
        section = names[0].rpartition(".")[0]
        keys = [names[0], *(f"{section}.{n}" for n in names[1:])]
        values = [v.strip() for v in m.group(2).split(", ")] if len(keys) > 1 else [m.group(2).strip()]
        if len(values) == 1:
            values *= len(keys)
        assert len(values) == len(keys), f"row {m.group(0)!r}: {len(keys)} keys, {len(values)} defaults"
        rows.update(zip(keys, values))
    return rows


def shown(default) -> str:
    """How the README writes a default (without its backticks)."""
    if default is None:
        return "null"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, (list, tuple)) and not default:
        return "[]"
    return str(default)


def test_readme_names_every_key_and_only_those():
    keys = {k: v for k, v in config_keys().items() if not k.startswith("debug.")}
    rows = readme_rows((ROOT / "README.md").read_text())
    assert sorted(set(keys) - set(rows)) == [], "keys without a README row"
    assert sorted(set(rows) - set(keys)) == [], "README rows naming no key"


def test_readme_defaults_are_the_code_defaults():
    keys = config_keys()
    rows = readme_rows((ROOT / "README.md").read_text())
    wrong = {k: (rows[k], shown(keys[k])) for k in rows if k in keys and rows[k].strip("`") != shown(keys[k])}
    assert wrong == {}


def test_the_check_sees_a_missing_row():
    rows = readme_rows("| `models.target` | `smollm2-135m-instruct` | the model |\n")
    assert set(config_keys()) - set(rows) and rows == {"models.target": "`smollm2-135m-instruct`"}
    grouped = readme_rows("| `storage.retries`, `retry_backoff_s` | 4, 0.5 | x |\n| `run.progress`, `metrics` | true | y |\n")
    assert grouped == {"storage.retries": "4", "storage.retry_backoff_s": "0.5", "run.progress": "true",
                       "run.metrics": "true"}
