"""The house's layers: every module of pipeline/ imports only its own layer or the layers below it,
and no modules import each other in a circle.

LAYERS lists the layers from the ground up; a module belongs to the layer whose package is the
longest prefix of its name. Imports inside functions count (they run too); imports under
`if TYPE_CHECKING:` count for the layer rule (a type names its layer as well) but not for circles
(they never run). The checker reads the source with `ast`: nothing is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [                                     # ground floor first
    ["pipeline.errors"],
    ["pipeline.engine.config"],
    ["pipeline.engine.core"],
    ["pipeline.engine.grammar"],
    ["pipeline.engine.kv"],
    ["pipeline.engine.backends"],
    ["pipeline.engine.parallel"],
    ["pipeline.engine.model"],
    ["pipeline.engine.drafting"],
    ["pipeline.engine.engine", "pipeline.engine"],   # the loop, and the engine's face (__init__)
    ["pipeline.loading"],
    ["pipeline.io"],
    ["pipeline.job"],
    ["pipeline.report"],
    ["pipeline.cluster"],
    ["pipeline.processor"],
    ["pipeline.synthetic"],
    ["pipeline.cli", "pipeline"],
]
TORCH_FREE = ["pipeline.engine.core.request", "pipeline.engine.core.scheduler", "pipeline.engine.core.prefix",
              "pipeline.engine.core.timing",
              "pipeline.engine.core.response_format",
              "pipeline.engine.config", "pipeline.errors"]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, name: str, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module of the package, line, runs) for every import in the file; `runs` is False
    under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node, runs):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.body:
                    visit_one(sub, False)
                for sub in child.orelse:
                    visit_one(sub, runs)
            else:
                visit_one(child, runs)

    def visit_one(node, runs):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, node.lineno, runs))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                found.append((sub if sub in modules else src, node.lineno, runs))
        else:
            visit(node, runs)

    visit(tree, True)
    return [(m, line, runs) for m, line, runs in found if m in modules]


def layer_of(name: str, layers: list[list[str]]) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(layers):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    if level is None:
        raise AssertionError(f"{name}: in no layer of LAYERS")
    return level


def graph(root: Path, package: str = "pipeline") -> dict[str, list[tuple[str, int, bool]]]:
    files = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    return {name: imports_of(path, name, set(files)) for name, path in files.items()}


def upward_imports(edges, layers) -> list[str]:
    bad = []
    for src, targets in edges.items():
        for dst, line, _ in targets:
            if layer_of(dst, layers) > layer_of(src, layers):
                bad.append(f"{src}:{line} imports {dst} (a higher layer)")
    return sorted(bad)


def circles(edges) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), over imports that run."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _, runs in edges.get(v, []):
            if not runs or w == v:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_no_import_runs_up_a_layer():
    assert upward_imports(graph(ROOT), LAYERS) == []


def test_no_circles():
    assert circles(graph(ROOT)) == []


def test_every_module_has_a_layer():
    for name in graph(ROOT):
        layer_of(name, LAYERS)


def test_bookkeeping_is_torch_free():
    for name in TORCH_FREE:
        path = ROOT / (name.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "torch" not in names, name


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("case", ["upward", "in-function", "circle", "clean"])
def test_the_checker_catches_what_it_guards(tmp_path, case):
    """The checks above on a planted house: an upward import (at the top or inside a function) and a
    circle are each reported; a clean house is not."""
    layers = [["pipeline.engine.core"], ["pipeline.engine.model"], ["pipeline.engine"], ["pipeline"]]
    files = {"pipeline/__init__.py": "", "pipeline/engine/__init__.py": "from .model.runner import R\n",
             "pipeline/engine/core/__init__.py": "", "pipeline/engine/model/__init__.py": "",
             "pipeline/engine/core/request.py": "X = 1\n",
             "pipeline/engine/core/verify.py": "from .request import X\n",
             "pipeline/engine/model/runner.py": "from ..core.verify import X\nR = X\n"}
    if case == "upward":
        files["pipeline/engine/core/verify.py"] += "from pipeline.engine.model.runner import R\n"
    if case == "in-function":
        files["pipeline/engine/core/verify.py"] += "def f():\n    from ..model import runner\n"
    if case == "circle":
        files["pipeline/engine/core/request.py"] = "from . import verify\nX = 1\n"
    _plant(tmp_path, files)
    edges = graph(tmp_path)
    up, loops = upward_imports(edges, layers), circles(edges)
    line = {"upward": 2, "in-function": 3}.get(case)
    assert up == ([f"pipeline.engine.core.verify:{line} imports pipeline.engine.model.runner (a higher layer)"]
                  if line else [])
    assert loops == {"circle": [["pipeline.engine.core.request", "pipeline.engine.core.verify"]],
                     "upward": [["pipeline.engine.core.verify", "pipeline.engine.model.runner"]],   # runner
                     "in-function": [["pipeline.engine.core.verify", "pipeline.engine.model.runner"]],  # imports verify
                     "clean": []}[case]
