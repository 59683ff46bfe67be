"""The package's layers import only downward: a walk of every module's imports (function-level ones
too) fails on an edge to a higher layer, or from one backend into another."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Lowest first. A module may import its own layer and the ones below it.
LAYERS = ("errors", "platforms", "specs", "registry", "engine", "ops", "backends", "perf", "conformance", "<top>")
_TOP = {"", "cli", "__main__"}  # kernelmux/__init__.py, cli.py, __main__.py


def _layer(module: str) -> str:
    """``kernelmux.a.b`` -> its layer's name."""
    head = module.split(".")[1] if "." in module else ""
    return "<top>" if head in _TOP else head


def _sources() -> list[pathlib.Path]:
    sources = []
    for layer in LAYERS[:-1]:
        path = ROOT / layer
        sources += [path.with_suffix(".py")] if path.with_suffix(".py").exists() else sorted(path.rglob("*.py"))
    return sources


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("kernelmux", *parts))


def _imports(path: pathlib.Path, text: str) -> list[tuple[int, str]]:
    """(line, kernelmux module) for every import in the file; ``from kernelmux.x import y`` counts
    as ``kernelmux.x.y`` so that ``from kernelmux import ops`` is an edge to ops."""
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name == "kernelmux" or name.startswith("kernelmux.")]


def _backend(module: str) -> str | None:
    """The backend package a module belongs to (None for shared ``backends._x`` modules)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "backends" and not parts[2].startswith("_"):
        return parts[2]
    return None


def _problems(texts: dict[pathlib.Path, str]) -> list[str]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    problems = []
    for path, text in texts.items():
        importer = _module_name(path)
        for line, imported in _imports(path, text):
            if imported == "kernelmux" or _layer(imported) not in rank:
                target = "<top>"
            else:
                target = _layer(imported)
            where = f"{path.relative_to(ROOT)}:{line} imports {imported}"
            if rank[target] > rank[_layer(importer)]:
                problems.append(f"{where}: layer {target} is above {_layer(importer)}")
            own, other = _backend(importer), _backend(imported)
            if own and other and own != other:
                problems.append(f"{where}: backend {own} reaches into backend {other}")
    return problems


def test_every_layer_has_modules():
    names = {_layer(_module_name(path)) for path in _sources()}
    assert names == set(LAYERS) - {"<top>"}


def test_no_module_imports_a_higher_layer():
    problems = _problems({path: path.read_text() for path in _sources()})
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("importer, imported, expected", [
    ("specs/x.py", "kernelmux.engine", "layer engine is above specs"),
    ("platforms/x.py", "kernelmux", "layer <top> is above platforms"),
    ("backends/cuda/x.py", "kernelmux.backends.triton.y", "backend cuda reaches into backend triton"),
])
def test_the_walk_sees_an_upward_edge(importer, imported, expected):
    # The check itself can fail: a module with one bad import, inside a function, is reported.
    text = f"def f():\n    from {imported.rpartition('.')[0] or imported} import {imported.rpartition('.')[2]}\n"
    if "." not in imported:
        text = f"def f():\n    import {imported}\n"
    problems = _problems({ROOT / importer: text})
    assert len(problems) == 1 and expected in problems[0]
