"""Logical-axis sharding: one rule table, the device mesh, and sharded model creation.

Every parameter and the main activations carry *logical* axis names (`embed`, `q_heads`, `batch`, ...).
`SHARDING_RULES` maps them to the mesh axes `data`, `fsdp`, `context`, `tensor`; changing the parallelism layout
means editing that table, never the layers. The layout it encodes:

- FSDP: every weight's `embed` dimension is split over `fsdp` x `context`; the batch is split over `data` x
  `fsdp`, so XLA all-gathers a layer's weights before using them and reduce-scatters their gradients (ZeRO-3).
- Context parallelism: the tokens of a row (`seq`) are split over `context`; attention re-splits its
  inputs by heads instead (`attn_seq` whole, `attn_heads` over `tensor` x `context`), see context_parallel.py,
  and so does Gated DeltaNet's recurrence (`linear_attn_heads`, deltanet.py).
  The weights are sharded over `context` too (as FSDP), so a long row on C devices costs no more parameter
  memory per device than C rows on them.
- Tensor parallelism: heads, MLP columns and the vocabulary are split over `tensor` (Megatron layout).
- Pure data parallelism: `data` only splits the batch; parameters are replicated across it.

The parameter's metadata key is our own (`logical_axes`), not flax's `out_sharding`: flax shards variables
carrying `out_sharding` eagerly at construction, which then requires a mesh even for single-device use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from primejax.utils.sections import ConfigError, Section, option

# JAX and flax are imported inside the functions that use them: the trainer's config (trainer/config.py) takes
# its mesh section from this module and stays importable without starting a backend.
if TYPE_CHECKING:
    import jax
    from flax import nnx
    from jax.sharding import Mesh, PartitionSpec

# The mesh axes, in device-array order: default size (-1 = all remaining devices) and what the size means.
# The one declaration of a mesh axis: MESH_AXES, the trainer's `trainer.mesh` section (MeshConfig below),
# mesh_sizes and make_mesh are built from it, so a new axis is a line here plus the rules that use it.
MESH_AXIS_TABLE: dict[str, tuple[int, str]] = {
    "data": (1, "data-parallel replicas"),
    "fsdp": (-1, "fully-sharded data-parallel size"),
    "context": (1, "context-parallel size: a row's tokens split over this many devices"),
    "tensor": (1, "tensor-parallel size"),
}
MESH_AXES = tuple(MESH_AXIS_TABLE)

# logical axis -> mesh axis (or axes, or None = replicated)
SHARDING_RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "layers": None,  # the stacked-layer axis is scanned over, never split
    "vocab": "tensor",
    "embed": ("fsdp", "context"),
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,  # norm scales are tiny; replicate
    # multi-head latent attention's compressed q / kv ranks (models/mla.py): the input dimension of q_b_proj
    # and kv_b_proj, split like `embed` (FSDP), which those weights do not have
    "latent": ("fsdp", "context"),
    # Gated DeltaNet's value heads (qwen3_5_text, models/deltanet.py): z and out_proj split by head over tensor
    "linear_heads": "tensor",
    # MoE experts (models/moe.py): the expert axis is split over fsdp (expert parallelism; how tokens meet
    # their experts is ModelConfig.expert_parallel); inside an expert nothing is split.
    "experts": "fsdp",
    "expert_embed": None,
    "expert_mlp": None,
    # activations
    "batch": ("data", "fsdp"),
    "seq": "context",
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    # attention's inputs and output under context parallelism: whole rows, heads split (context_parallel.py)
    "attn_seq": None,
    "attn_heads": ("tensor", "context"),
    "attn_kv_heads": ("tensor", "context"),
    # Gated DeltaNet's conv and recurrence under context parallelism: whole rows, heads split (deltanet.py)
    "linear_attn_heads": ("tensor", "context"),
    # the LM head's rows: a row's context shards become rows of their own (context_parallel.fold_context)
    "batch_context": ("data", "fsdp", "context"),
}

LogicalAxes = Sequence[str | None]


def _rule(name: str | None, rules: dict) -> tuple[str, ...]:
    if name is None:
        return ()
    if name not in rules:
        raise KeyError(f"logical axis {name!r} has no entry in the sharding rules")
    target = rules[name]
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def mesh_axes(logical: str) -> tuple[str, ...]:
    """The mesh axes a logical axis is split over, by the table: every module outside it names logical axes
    (`mesh_axes("experts")`, `mesh_axes("seq")`), so moving an axis is an edit of the table alone."""
    return _rule(logical, SHARDING_RULES)


def spec_entry(axes: Sequence[str]) -> str | tuple[str, ...] | None:
    """One PartitionSpec entry for `axes`: None, the single name, or the tuple (the spelling JAX compares)."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def axis_size(mesh: Mesh | jax.sharding.AbstractMesh | None, logical: str) -> int:
    """How many ways `mesh` splits the logical axis `logical` (1 without a mesh)."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape.get(a, 1) for a in mesh_axes(logical))


def logical_to_spec(
    logical_axes: LogicalAxes,
    shape: Sequence[int] | None = None,
    mesh: Mesh | jax.sharding.AbstractMesh | None = None,
    rules: dict | None = None,
) -> PartitionSpec:
    """PartitionSpec for a tensor whose dimensions have the given logical names.

    Raises if two logical axes of the tensor map to the same mesh axis. With `shape` and `mesh`, mesh axes of
    size 1 are dropped and so are axes that do not divide the dimension (e.g. 2 kv heads on tensor=4): that
    dimension is then replicated over them rather than padded.
    """
    from jax.sharding import PartitionSpec

    rules = SHARDING_RULES if rules is None else rules
    used: dict[str, str] = {}
    entries: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(logical_axes):
        axes = _rule(name, rules)
        for ax in axes:
            if ax in used:
                raise ValueError(
                    f"logical axes {used[ax]!r} and {name!r} both map to mesh axis {ax!r} "
                    f"in one tensor with axes {tuple(logical_axes)}"
                )
            used[ax] = name  # type: ignore[assignment]
        if mesh is not None and shape is not None:
            kept: list[str] = []
            for ax in axes:
                n = mesh.shape[ax]
                if n > 1 and shape[dim] % (math.prod(mesh.shape[a] for a in kept) * n) == 0:
                    kept.append(ax)
            axes = tuple(kept)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def _check_sizes(sizes: Mapping[str, int]) -> None:
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(axis, f"must be a positive size or -1 (the rest), got {size}")
    if sum(s == -1 for s in sizes.values()) > 1:
        raise ConfigError("", "at most one axis may be -1")


def mesh_section(table: Mapping[str, tuple[int, str]] = MESH_AXIS_TABLE) -> type[Section]:
    """The config section of a mesh table: one int option per axis (its default and doc), sizes checked."""

    def check(self) -> None:
        _check_sizes(self.to_dict())

    fields = [(axis, int, option(default, doc)) for axis, (default, doc) in table.items()]
    namespace = {
        "check": check,
        "__doc__": "Device mesh axes; -1 = all remaining devices (at most one axis).",
    }
    cls = dataclasses.make_dataclass(
        "MeshConfig", fields, bases=(Section,), namespace=namespace, frozen=True, kw_only=True
    )
    cls.__module__ = __name__
    return cls


# `trainer.mesh` (trainer/config.py re-exports it): its keys are MESH_AXES.
MeshConfig = mesh_section()


def mesh_sizes(n_devices: int, *positional: int, **sizes: int) -> dict[str, int]:
    """Every axis's size for `n_devices` (sizes by keyword, or positionally in MESH_AXES order; unnamed axes
    take their table default), the one -1 (if any) filled in with the remaining devices; ValueError (one line)
    when they do not cover exactly `n_devices`."""
    if len(positional) > len(MESH_AXES):
        raise TypeError(f"at most {len(MESH_AXES)} positional mesh sizes ({', '.join(MESH_AXES)})")
    given = dict(zip(MESH_AXES, positional, strict=False))
    for axis, size in sizes.items():
        if axis not in MESH_AXIS_TABLE:
            raise ValueError(f"unknown mesh axis {axis!r} (one of {', '.join(MESH_AXES)})")
        if axis in given:
            raise TypeError(f"mesh axis {axis!r} given twice")
        given[axis] = size
    out = {axis: given.get(axis, default) for axis, (default, _) in MESH_AXIS_TABLE.items()}
    named = " ".join(f"{a}={s}" for a, s in out.items())
    if sum(s == -1 for s in out.values()) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {named}")
    known = math.prod(s for s in out.values() if s != -1)
    for axis, size in out.items():
        if size == -1:
            if n_devices % known:
                raise ValueError(
                    f"{n_devices} devices are not divisible by the other axes' product {known} ({named})"
                )
            out[axis] = n_devices // known
    if math.prod(out.values()) != n_devices:
        shape = " x ".join(f"{a}={s}" for a, s in out.items())
        raise ValueError(f"mesh {shape} needs {math.prod(out.values())} devices, have {n_devices}")
    return out


def make_mesh(*positional: int, devices: Sequence | None = None, **sizes: int) -> Mesh:
    """A mesh over MESH_AXES (sizes as in `mesh_sizes`; one may be -1 = all remaining devices).

    Axes are Auto (GSPMD propagation): the model relies on sharding constraints, not explicit-sharding types.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    shape = list(mesh_sizes(len(devices), *positional, **sizes).values())
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def current_mesh() -> jax.sharding.AbstractMesh | None:
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def constrain(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    """Sharding constraint by logical axes under the active mesh (`jax.set_mesh`); a no-op without one."""
    import jax

    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))


def param_spec(var: nnx.Variable, mesh: Mesh | None = None) -> PartitionSpec:
    from jax.sharding import PartitionSpec

    axes = var.get_metadata().get("logical_axes")
    if axes is None:
        return PartitionSpec()
    return logical_to_spec(axes, var.shape, mesh)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """The NamedSharding of every variable in `state` (same tree), from its logical axes and the rules."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding

    def one(var):
        return var.replace(NamedSharding(mesh, param_spec(var, mesh)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_sharded(constructor: Callable[[], nnx.Module], mesh: Mesh | None) -> nnx.Module:
    """Build a module with every parameter created directly in its sharded layout (never whole on one device)."""
    import jax
    from flax import nnx

    # Always under jit, also without a mesh: one compiled program instead of many eager ops, and values
    # bit-identical whatever the mesh (threefry is partitionable, so sharding does not change the draws).
    graphdef, abstract_state = nnx.split(nnx.eval_shape(constructor))
    if mesh is None:
        return nnx.merge(graphdef, jax.jit(lambda: nnx.state(constructor()))())
    shardings = state_shardings(abstract_state, mesh)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda: nnx.state(constructor()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)
