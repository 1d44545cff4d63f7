"""Decisions flow one way: every import of the package, function-local ones included, points down the layer order
written in docs/design.md ("Layers"), and no modules import each other in a circle."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "mxgemm"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports() -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports anywhere in its source (``from . import
    x`` names the module ``x`` where there is one, else the package it is taken from)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "mxgemm")
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                if target.split(".")[0] == "mxgemm":
                    found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in files else target for a in node.names)
        edges[name] = found - {name}
    return edges


def documented_layers() -> list[tuple[str, list[str]]]:
    """The layers of docs/design.md, lowest first: (name, module patterns without the ``mxgemm.`` prefix)."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    items = re.finditer(r"^\d+\. \*\*([\w ]+)\*\*: (.+?)(?=^\d+\. |\Z)", section, re.M | re.S)
    layers = [(m[1], re.findall(r"`([\w.*]+)`", m[2])) for m in items]
    assert layers, "docs/design.md has no numbered list of layers under '## Layers'"
    return layers


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    short = module.removeprefix("mxgemm").removeprefix(".") or "mxgemm"
    for index, (_, patterns) in enumerate(layers):
        for pattern in patterns:
            if short == pattern or (pattern.endswith(".*") and short.startswith(pattern[:-1])):
                return index
    return None


def upward_arrows(edges: dict[str, set[str]], layers) -> list[str]:
    return [
        f"{a} ({layers[layer_of(a, layers)][0]}) imports {b} ({layers[layer_of(b, layers)][0]})"
        for a, targets in sorted(edges.items())
        for b in sorted(targets)
        if layer_of(b, layers) > layer_of(a, layers)
    ]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    layers = documented_layers()
    assert [m for m in sorted(package_imports()) if layer_of(m, layers) is None] == []


def test_imports_point_down_the_layers():
    assert upward_arrows(package_imports(), documented_layers()) == []


def test_no_modules_import_each_other_in_a_circle():
    assert circles(package_imports()) == []


@pytest.mark.parametrize(
    "edge, caught",
    [
        (("mxgemm.backends.hybrid_sm90", "mxgemm.ops"), "upward"),  # a backend calling back into the ops layer
        (("mxgemm.tuning", "mxgemm.fastcall"), "circle"),  # the store telling the C++ table, the table reading it
    ],
)
def test_the_checks_catch_a_planted_arrow(edge, caught):
    """The two checks fail on the arrows this architecture removed, were they to come back."""
    edges = {k: set(v) for k, v in package_imports().items()}
    edges[edge[0]].add(edge[1])
    if caught == "upward":
        assert upward_arrows(edges, documented_layers()) == [
            f"{edge[0]} (backends) imports {edge[1]} (ops)",
        ]
    else:
        assert circles(edges) == [sorted(edge)]
