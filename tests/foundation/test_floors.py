"""The package's floors (docs/architecture.md#floors-and-arrows), read from the code's own imports.

A room is one folder of `primejax/` (or a top-level module); every import counts, at module level, deferred
inside a function or under TYPE_CHECKING. Two rooms that import each other, directly or through others, are a
loop: one of its arrows runs back up. Each loop still standing is listed in docs/architecture.md with its
reason; a new one fails here.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "primejax"

# Room pairs whose loop is known, each with its reason in docs/architecture.md#floors-and-arrows.
KNOWN_LOOPS = {
    frozenset({"utils", "contracts"}),  # utils/monitor.py and faults.py write where contracts/rundir.py says
}
# What the weight transports may import: they sit below every process's component.
TRANSPORTS_USE = {"transports", "contracts", "models", "utils"}


def _module(path: Path, pkg: Path = PKG) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def _imports(path: Path, module: str) -> set[str]:
    """Every primejax module `path` names in an import statement (absolute or relative)."""
    out = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m == "primejax" or m.startswith("primejax.")}


@functools.cache  # one read of the tree for every test here
def _room_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        module = _module(path)
        if module == "primejax":
            continue
        room = _room(module)
        for target in _imports(path, module):
            if target != "primejax" and _room(target) != room:
                graph.setdefault(room, set()).add(_room(target))
    return graph


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_imports_are_read_deferred_and_relative_ones_included(tmp_path):
    f = tmp_path / "primejax" / "trainer" / "x.py"
    f.parent.mkdir(parents=True)
    f.write_text("from . import loop\ndef g():\n    from primejax.config import cli\n")
    assert _imports(f, _module(f, tmp_path / "primejax")) == {
        "primejax.trainer",
        "primejax.trainer.loop",
        "primejax.config",
        "primejax.config.cli",
    }


def test_no_room_loop_beyond_the_known_ones():
    graph = _room_graph()
    loops = {frozenset({a, b}) for a, targets in graph.items() for b in targets if a in _reach(graph, b)}
    assert loops <= KNOWN_LOOPS, f"new import loops between rooms: {sorted(map(sorted, loops - KNOWN_LOOPS))}"


def test_nothing_imports_the_entry_points():
    # `python -m primejax.<process>` runs primejax/entrypoints/<process>.py by name (runpy), not by import.
    users = {room for room, targets in _room_graph().items() if "entrypoints" in targets}
    assert users == set(), f"rooms importing primejax.entrypoints: {sorted(users)}"


def test_the_weight_transports_import_no_process_component():
    used = _room_graph().get("transports", set())
    assert used <= TRANSPORTS_USE, f"transports/ imports {sorted(used - TRANSPORTS_USE)}"
