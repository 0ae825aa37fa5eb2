"""The package layout is the architecture: dependencies point one way, torch-free parts stay so."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpipe
from conftest import fresh_python

ROOT = Path(gpipe.__file__).parent

# Layers from the bottom up: a module may import its own layer and the layers below it.
LAYERS = [
    ("units", "recompute", "schedule", "data"),
    ("analysis",),
    (
        "structure",
        "dataflow",
        "grouping",
        "microbatch",
        "partition",
        "randomness",
        "batchnorm",
        "arguments",
        "loss",
        "tied",
    ),
    ("runtime",),
    ("balance", "models", "skip", "split", "generation"),
    ("core", "local_layout", "bench"),
    ("pipe",),
    ("distributed",),
    ("planning",),
    ("demo", "report"),
    ("cli",),
]
# Must import without PyTorch: the simulator, timelines and `gpipe --help` start at once.
TORCH_FREE = ("units", "recompute", "schedule", "data", "analysis", "cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(name: str) -> set[str]:
    """The gpipe modules ``name`` imports at run time, anywhere in its body (lazy ones too)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gpipe")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gpipe"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def layer_of(name: str) -> int:
    part = name.split(".")[1] if "." in name else ""
    for rank, members in enumerate(LAYERS):
        if part in members:
            return rank
    raise AssertionError(f"{name} belongs to no layer: add it to LAYERS")


def test_no_module_imports_itself_through_a_cycle() -> None:
    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for nxt in GRAPH[node]:
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [c for name in GRAPH if (c := cycle_from(name))]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_dependencies_point_down_the_layers() -> None:
    upward = [
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        if name != "gpipe"
        for dep in deps
        if dep != "gpipe" and layer_of(dep) > layer_of(name)
    ]
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize(
    "name",
    sorted(n for n in MODULES if n.removeprefix("gpipe.").split(".")[0] in TORCH_FREE),
)
def test_torch_free_modules_do_not_import_torch(name: str) -> None:
    load = "from gpipe.cli import build_parser; build_parser()" if name == "gpipe.cli" else ""
    code = f"import sys, {name}\n{load}\nprint('torch' in sys.modules)"
    assert fresh_python(code).strip() == "False", f"{name} loads torch"
