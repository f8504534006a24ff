"""The house's layout, read from the source: every subsystem a folder of at most about 15 modules, no module over 400
lines, no import circle between modules, `trainer_bridge` free of the worker (`rollout.service`), the wire contract
(`rollout.protocol`) free of the engine and the worker, the scheduler free of torch, and every moved module's old
path still importable with a DeprecationWarning."""

from __future__ import annotations

import ast
import functools
import importlib
import sys
import warnings
from pathlib import Path

import pytest

from rollout.moved_modules import MOVED_MODULES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout", "trainer_bridge")
MOST_MODULES_PER_FOLDER = 15
MOST_LINES = 400


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the packages, by its dotted name (read once: callers do not change it)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports at run time (not those under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for statement in branch.body
        for node in ast.walk(statement)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name, path, modules()) for name, path in modules().items()}


def test_no_folder_holds_more_than_about_15_modules():
    crowded = {}
    for folder in {path.parent for path in modules().values()}:
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        if count > MOST_MODULES_PER_FOLDER:
            crowded[str(folder.relative_to(ROOT))] = count
    assert not crowded, f"folders over {MOST_MODULES_PER_FOLDER} modules: {crowded}"


def test_every_subsystem_folder_has_a_map():
    unmapped = [str(p.parent.relative_to(ROOT)) for p in modules().values() if not (p.parent / "__init__.py").exists()]
    assert not unmapped
    empty = [
        n for n, p in modules().items() if p.name == "__init__.py" and not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not empty, f"packages without a map in their docstring: {empty}"


def test_no_module_is_over_400_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MOST_LINES}
    assert not long, long


def test_no_import_circle_between_modules():
    """Package __init__ files re-exporting their own modules are not edges of a circle (they are maps)."""
    graph = {
        name: {t for t in targets if not modules()[t].name == "__init__.py"}
        for name, targets in GRAPH.items()
        if modules()[name].name != "__init__.py"
    }
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                circles.append(trail[trail.index(target) :] + [target])
            elif target not in state:
                visit(target, [*trail, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, circles[:5]


def test_no_import_circle_between_folders():
    """Each folder is a subsystem: its modules may use a folder above or beside it, but no two folders use each
    other, directly or around a circle (a package's own files are the base its subfolders build on)."""
    folder_of = {name: str(path.parent.relative_to(ROOT)) for name, path in modules().items()}
    edges: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        if modules()[name].name == "__init__.py":
            continue
        for target in targets:
            if modules()[target].name != "__init__.py" and folder_of[target] != folder_of[name]:
                edges.setdefault(folder_of[name], set()).add(folder_of[target])

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            folder = todo.pop()
            if folder == goal:
                return True
            if folder not in seen:
                seen.add(folder)
                todo.extend(edges.get(folder, ()))
        return False

    circles = sorted((a, b) for a, targets in edges.items() for b in targets if reaches(b, a))
    assert not circles, circles


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("trainer_bridge", "rollout.service"),
        ("rollout.protocol", "rollout.service"),
        ("rollout.protocol", "rollout.engine"),
        ("rollout.engine", "rollout.service"),
        ("rollout.engine", "trainer_bridge"),
        ("rollout.service", "trainer_bridge"),
    ],
)
def test_nothing_imports_across_its_layer(layer, forbidden):
    crossing = {
        name: sorted(t for t in targets if t == forbidden or t.startswith(forbidden + "."))
        for name, targets in GRAPH.items()
        if name == layer or name.startswith(layer + ".")
    }
    assert not {name: targets for name, targets in crossing.items() if targets}


@pytest.mark.parametrize("name", sorted(n for n in modules() if n.startswith("rollout.engine.scheduling.")))
def test_scheduling_is_free_of_torch(name):
    """Importing any scheduling module (and all it imports) loads no torch: the scheduler's decisions are plain
    Python, testable and cheap."""
    import subprocess

    probe = f"import sys, {name}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT).returncode == 0, f"{name} loads torch"


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_keeps_its_old_path_with_a_warning(old):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED_MODULES[old])
    assert any(issubclass(w.category, DeprecationWarning) and MOVED_MODULES[old] in str(w.message) for w in caught)
