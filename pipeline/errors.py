"""The error every config section raises for a bad value, naming its key (`engine.max_num_seqs: ...`).

It knows nothing about the sections themselves; each lives beside what it configures.
"""
from __future__ import annotations


class ConfigError(ValueError):
    pass


def one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: expected one of {list(allowed)}, got {value!r}")
