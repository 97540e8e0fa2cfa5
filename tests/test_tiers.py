"""The fast tier (`bash scripts/test.sh -m "not slow"`, the one to run before each commit) reaches every
test module: each holds at least one test not marked slow."""
from __future__ import annotations

from pathlib import Path

import pytest


def fully_slow(items) -> list[str]:
    """Test modules all of whose collected tests are marked slow."""
    fast, modules = set(), set()
    for item in items:
        module = Path(str(item.fspath)).name
        modules.add(module)
        if item.get_closest_marker("slow") is None:
            fast.add(module)
    return sorted(modules - fast)


def test_every_module_is_in_the_fast_tier(request):
    from conftest import COLLECTED
    items = request.config.stash[COLLECTED]         # the whole collection, whatever -m or -k selected
    if len({Path(str(i.fspath)).parent for i in items}) < 3:
        pytest.skip("only part of the suite was collected: run it over tests/ to judge the tiers")
    assert fully_slow(items) == []


def test_the_check_sees_a_module_with_only_slow_tests():
    class Item:
        def __init__(self, path, slow):
            self.fspath, self.slow = path, slow

        def get_closest_marker(self, name):
            return object() if self.slow else None
    assert fully_slow([Item("tests/a.py", True), Item("tests/b.py", False), Item("tests/a.py", True)]) == ["a.py"]
