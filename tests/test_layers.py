"""The package's layers (README "Layout"): core → format → cpu → gpu → plan → serve → tools. A module imports only
from its own layer or the ones below it, the import graph has no cycle, and package-internal imports sit at the top
of their files (LAZY lists the exceptions and why). Read with ast: nothing is imported to check it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

PKG = Path(__file__).resolve().parent.parent / "legacy_engine"
LAYERS = ("core", "format", "cpu", "gpu", "plan", "serve", "tools")
# package-internal imports inside functions, each with its reason
LAZY = {
    ("gpu.runtime", "core._native"): "the toolchain and `python -m legacy_engine.gpu build` need no compiled core",
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(name: str, path: Path, mods: dict) -> list[tuple[str, bool]]:
    """(imported module, at the top of the file) for each package-internal import of a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "":
        pkg = []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[:len(pkg) - node.level + 1] if node.level > 1 else pkg
            target = ".".join(base + ([node.module] if node.module else []))
            cands = [target] + [f"{target}.{a.name}".lstrip(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("legacy_engine"):
            target = node.module[len("legacy_engine"):].lstrip(".")
            cands = [target] + [f"{target}.{a.name}".lstrip(".") for a in node.names]
        else:
            continue
        top = node in tree.body
        for c in cands:
            if c in mods and c != name and c != "":
                out.append((c, top))
    return out


def _layer(name: str) -> int | None:
    head = name.split(".")[0]
    return LAYERS.index(head) if head in LAYERS else None


def test_imports_point_down_and_sit_at_the_top():
    mods = _modules()
    up, inner = [], []
    for name, path in mods.items():
        for target, top in _imports(name, path, mods):
            lo, lt = _layer(name), _layer(target)
            if lo is not None and lt is not None and lt > lo:
                up.append(f"{name} -> {target}")
            if not top and (name, target) not in LAZY:
                inner.append(f"{name} -> {target}")
    assert not up, "upward imports:\n  " + "\n  ".join(sorted(set(up)))
    assert not inner, "imports inside functions:\n  " + "\n  ".join(sorted(set(inner)))


def test_no_import_cycle():
    mods = _modules()
    edges = {n: {t for t, _ in _imports(n, p, mods) if t != n and not t.startswith(n + ".")} for n, p in mods.items()}
    for n in list(edges):     # a package's __init__ re-exporting its modules is not a cycle with them
        if mods[n].name == "__init__.py":
            edges[n] = {t for t in edges[n] if not t.startswith(n + ".")}
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = 1
        stack.append(n)
        for t in edges.get(n, ()):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[n] = 2
    for n in sorted(edges):
        if n not in state:
            visit(n, [])
    assert not cycles, "import cycles:\n  " + "\n  ".join(" -> ".join(c) for c in cycles[:10])


def test_no_module_outside_the_layers():
    stray = [n for n in _modules() if n not in ("", "__main__") and _layer(n) is None]
    assert not stray, stray


FILE_LINES_MAX = 720        # "about 700"
FUNCTION_LINES_MAX = 80
PARSERS = {"format.gguf_file.parse_header", "format.gguf_model.read_hparams"}   # one branch per field: long, flat


def test_files_and_functions_are_short():
    long_files, long_funcs = [], []
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > FILE_LINES_MAX:
            long_files.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > FUNCTION_LINES_MAX and f"{name}.{node.name}" not in PARSERS:
                    long_funcs.append(f"{name}.{node.name}: {n} lines")
    assert not long_files and not long_funcs, "\n  ".join(["too long:"] + long_files + long_funcs)
