"""`RunDir` (primejax/contracts/rundir.py) is the only place a run-directory path is spelled.

The check walks the syntax tree of every module of the package (a regex is easy to slip past: a name split
over an f-string, a `joinpath`, a constant bound to a variable first). A run-directory name counts as spelled
where it is an operand of `/`, an argument of `Path(...)`, `.joinpath(...)` or `.with_name(...)`, or where a
file name of the run directory's own (pids.json, the lock, the admin token) appears at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import primejax
from primejax.contracts.rundir import RunDir

PACKAGE = Path(primejax.__file__).parent
OWNER = PACKAGE / "contracts" / "rundir.py"
# Every entry of the run directory (RunDir.ENTRIES plus what lives below them and beside them).
DIR_NAMES = set(RunDir.ENTRIES) | {"configs", "transfers", "previous", "final", "trainer", "orchestrator"}
FILE_NAMES = {RunDir.PIDS_FILE, RunDir.LOCK_FILE, RunDir.ADMIN_TOKEN_FILE}
ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr"}  # an attribute of that name is not a path
PATH_CALLS = {"Path", "PurePath", "joinpath", "with_name"}


def _strings(node: ast.AST) -> list[str]:
    """The literal text of a string constant or of an f-string's literal parts, split at '/'."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        texts = [node.value]
    elif isinstance(node, ast.JoinedStr):
        texts = [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    else:
        return []
    return [part for t in texts for part in t.split("/")]


def _run_dir_name(part: str) -> bool:
    """`part` names a run-directory entry, bare or as a temp/old sibling (`.broadcasts.old`, `.stale.tmp`)."""
    return part.lstrip(".").split(".")[0] in DIR_NAMES


def spelled_paths(source: str, filename: str) -> list[str]:
    """`file:line: text` for every run-directory path spelled in `source`."""
    found = []
    tree = ast.parse(source, filename)
    attribute_names = {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_CALLS
        for arg in node.args[1:2]
    }
    for node in ast.walk(tree):
        operands: list[ast.AST] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            operands = [node.left, node.right]
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in PATH_CALLS:
                operands = list(node.args)
        for op in operands:
            found += [f"{filename}:{op.lineno}: {s!r}" for s in _strings(op) if _run_dir_name(s)]
        if isinstance(node, ast.Constant) and node.value in FILE_NAMES and id(node) not in attribute_names:
            found.append(f"{filename}:{node.lineno}: {node.value!r}")
    return found


def test_no_run_directory_path_is_spelled_outside_rundir():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != OWNER:
            found += spelled_paths(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "run-directory paths spelled outside RunDir:\n" + "\n".join(found)


def test_the_check_finds_each_way_of_spelling_a_path():
    cases = {
        'root / "transfers"': 1,
        'root / "stale" / stamp': 1,
        'Path(root, "previous")': 1,
        'root.joinpath("checkpoints")': 1,
        'final.with_name(f".{final.name}.export.tmp")': 0,  # no run-dir name in it
        'd.with_name(f".broadcasts.old")': 1,
        'root / f"logs/{name}.log"': 1,
        'PIDS = "pids.json"': 1,
        'getattr(state, "admin_token", None)': 0,
        'monitor.scalars("trainer", x)': 0,  # a process name, not a path
        'x = {"metrics": 1}': 0,
    }
    for source, n in cases.items():
        assert len(spelled_paths(source, "case.py")) == n, source
