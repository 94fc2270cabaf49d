"""A mesh axis is declared once: `MESH_AXIS_TABLE` in primejax/models/sharding.py.

The trainer's `trainer.mesh` section, `mesh_sizes` and `make_mesh` are built from the table, so a new axis added
there reaches all three with no other edit (checked by adding one here); and no module of the package or of
tools/ spells a mesh axis where it means one (a PartitionSpec, a collective's axis name, a mesh's shape), which
a walk over their syntax trees checks.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jax
import pytest

import primejax
from primejax.models import sharding
from primejax.trainer import config as trainer_config
from primejax.utils.sections import ConfigError

ROOT = Path(primejax.__file__).parent.parent
OWNER = ROOT / "primejax" / "models" / "sharding.py"
# Calls whose string arguments are mesh axes (jax.sharding / jax.lax), and keywords that take an axis name.
AXIS_CALLS = {
    "PartitionSpec",
    "P",
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "psum_scatter",
    "all_gather",
    "all_to_all",
    "ppermute",
    "axis_index",
    "axis_size",
}
AXIS_KEYWORDS = {"axis_name", "axis_names"}


def _axis_literals(node: ast.AST | None) -> list[str]:
    """Mesh-axis names written as string constants in `node` (directly, or inside a tuple/list)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in sharding.MESH_AXES else []
    if isinstance(node, (ast.Tuple, ast.List)):
        return [name for elt in node.elts for name in _axis_literals(elt)]
    return []


def spelled_axes(source: str, filename: str) -> list[str]:
    """`file:line: axis` for every mesh axis spelled in a place that means a mesh axis."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Call):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if called in AXIS_CALLS:
                names += [n for arg in node.args for n in _axis_literals(arg)]
            names += [n for kw in node.keywords if kw.arg in AXIS_KEYWORDS for n in _axis_literals(kw.value)]
            # mesh.shape.get("fsdp")
            if called == "get" and isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Attribute):
                if fn.value.attr == "shape" and node.args:
                    names += _axis_literals(node.args[0])
        elif isinstance(node, ast.Subscript):  # mesh.shape["fsdp"]
            if isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
                names += _axis_literals(node.slice)
        found += [f"{filename}:{node.lineno}: {name!r}" for name in names]
    return found


def test_checker_catches_each_spelling():
    src = (
        'P("fsdp")\nPartitionSpec(None, ("data", "fsdp"))\njax.lax.psum(x, "tensor")\n'
        'shard_map(f, axis_names={"context"})\nmesh.shape["fsdp"]\nmesh.shape.get("data", 1)\n'
        'jax.lax.all_to_all(x, axis_name="fsdp", split_axis=0, concat_axis=0)\n'
        # logical names and non-mesh uses of the words are fine
        'mesh_axes("experts")\naxis_size(mesh, "batch")\nd["data"]\nf("fsdp")\n'
    )
    found = spelled_axes(src, "x.py")
    assert [f.split(": ")[1] for f in found] == [
        "'fsdp'",
        "'data'",
        "'fsdp'",
        "'tensor'",
        "'fsdp'",
        "'data'",
        "'fsdp'",
    ], found


def test_no_mesh_axis_spelled_outside_the_table():
    files = sorted((ROOT / "primejax").rglob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    assert len(files) > 50
    found = [
        hit
        for path in files
        if path != OWNER
        for hit in spelled_axes(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not found, "mesh axes spelled outside models/sharding.py (use mesh_axes/axis_size):\n" + "\n".join(
        found
    )


def test_mesh_section_is_the_table():
    assert trainer_config.MeshConfig is sharding.MeshConfig
    fields = dataclasses.fields(sharding.MeshConfig)
    assert tuple(f.name for f in fields) == sharding.MESH_AXES
    for f in fields:
        default, doc = sharding.MESH_AXIS_TABLE[f.name]
        assert (f.default, f.metadata["doc"]) == (default, doc)
    cfg = trainer_config.TrainerConfig()
    assert tuple(cfg.mesh.to_dict()) == sharding.MESH_AXES
    with pytest.raises(ConfigError, match="at most one axis may be -1"):
        sharding.MeshConfig(data=-1)
    with pytest.raises(ConfigError, match="tensor: must be a positive size"):
        sharding.MeshConfig(tensor=0)


def test_a_new_axis_is_one_table_line(monkeypatch):
    table = dict(sharding.MESH_AXIS_TABLE, expert=(1, "expert-parallel size"))
    monkeypatch.setattr(sharding, "MESH_AXIS_TABLE", table)
    monkeypatch.setattr(sharding, "MESH_AXES", tuple(table))

    section = sharding.mesh_section(table)
    assert section(expert=2).to_dict() == {"data": 1, "fsdp": -1, "context": 1, "tensor": 1, "expert": 2}
    with pytest.raises(ConfigError, match="expert: must be a positive size"):
        section(expert=0)
    assert sharding.mesh_sizes(1) == {"data": 1, "fsdp": 1, "context": 1, "tensor": 1, "expert": 1}
    mesh = sharding.make_mesh(**section().to_dict(), devices=jax.devices()[:1])
    assert mesh.axis_names == ("data", "fsdp", "context", "tensor", "expert")


def test_mesh_sizes_by_keyword_and_position():
    assert sharding.mesh_sizes(8, fsdp=-1, tensor=2) == {"data": 1, "fsdp": 4, "context": 1, "tensor": 2}
    assert sharding.mesh_sizes(8, 2, 2, 1, 2) == {"data": 2, "fsdp": 2, "context": 1, "tensor": 2}
    for bad, message in (
        (dict(expert=2), "unknown mesh axis 'expert'"),
        (dict(data=-1), "at most one mesh axis may be -1"),
        (dict(fsdp=3), "needs 3 devices, have 8"),
        (dict(fsdp=-1, tensor=3), "not divisible"),
    ):
        with pytest.raises(ValueError, match=message):
            sharding.mesh_sizes(8, **bad)
