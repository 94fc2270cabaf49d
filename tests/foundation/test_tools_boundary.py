"""tools/ (benchmarks and commands run from a checkout) stays out of the installed package, and neither the
package nor the tests import it: what a test checks lives in primejax/ or tests/ (issue 49). A tool's command
line may still be run by a test as a process started in the checkout, as its users run it."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def _imports_tools(path: Path) -> list[str]:
    """`import tools...` / `from tools... import` lines of one file, as "path:line"."""
    found, text = [], path.read_text()
    if "tools" not in text:  # most files: no parse needed
        return found
    for node in ast.walk(ast.parse(text, str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        if any(n == "tools" or n.startswith("tools.") for n in names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_wheel_holds_no_tools_package():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
    assert "primejax" in packages and "primejax.trainer" in packages
    assert not [p for p in packages if p == "tools" or p.startswith("tools.")], packages


def test_neither_the_package_nor_the_tests_import_tools():
    files = sorted([*(ROOT / "primejax").rglob("*.py"), *(ROOT / "tests").rglob("*.py")])
    assert len(files) > 100  # the walk found the trees
    assert [hit for f in files for hit in _imports_tools(f)] == []


def test_tools_stay_within_their_line_budget():
    """tools/ holds the benchmarks that earned their place, at most 3,500 lines (issue 49); the rest is in git
    history with its results in docs/benchmarks_log.md."""
    lines = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "tools").glob("*.py")}
    assert len(lines) > 5  # the glob found the folder
    assert sum(lines.values()) <= 3500, sorted(lines.items(), key=lambda kv: -kv[1])
