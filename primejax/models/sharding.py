"""Logical-axis sharding: one rule table, the device mesh, and sharded model creation.

Every parameter and the main activations carry *logical* axis names (`embed`, `q_heads`, `batch`, ...).
`SHARDING_RULES` maps them to the mesh axes `data`, `fsdp`, `context`, `tensor`; changing the parallelism layout
means editing that table, never the layers. The layout it encodes:

- FSDP: every weight's `embed` dimension is split over `fsdp` x `context`; the batch is split over `data` x
  `fsdp`, so XLA all-gathers a layer's weights before using them and reduce-scatters their gradients (ZeRO-3).
- Context parallelism: the tokens of a row (`seq`) are split over `context`; attention alone re-splits its
  inputs by heads instead (`attn_seq` whole, `attn_heads` over `tensor` x `context`), see context_parallel.py.
  The weights are sharded over `context` too (as FSDP), so a long row on C devices costs no more parameter
  memory per device than C rows on them.
- Tensor parallelism: heads, MLP columns and the vocabulary are split over `tensor` (Megatron layout).
- Pure data parallelism: `data` only splits the batch; parameters are replicated across it.

The parameter's metadata key is our own (`logical_axes`), not flax's `out_sharding`: flax shards variables
carrying `out_sharding` eagerly at construction, which then requires a mesh even for single-device use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "context", "tensor")

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


def mesh_sizes(
    n_devices: int, data: int = 1, fsdp: int = -1, tensor: int = 1, *, context: int = 1
) -> dict[str, int]:
    """The ("data", "fsdp", "context", "tensor") sizes for `n_devices`, the one -1 (if any) filled in with the
    remaining devices; ValueError (one line) when they do not cover exactly `n_devices`."""
    sizes = [data, fsdp, context, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(
            f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} context={context} tensor={tensor}"
        )
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise ValueError(f"{n_devices} devices are not divisible by data*tensor*... = {known}")
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ValueError(
            f"mesh data={sizes[0]} x fsdp={sizes[1]} x context={sizes[2]} x tensor={sizes[3]} needs "
            f"{math.prod(sizes)} devices, "
            f"have {n_devices}"
        )
    return dict(zip(MESH_AXES, sizes, strict=True))


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence | None = None, *, context: int = 1
) -> Mesh:
    """A ("data", "fsdp", "context", "tensor") mesh; one size may be -1 (= all remaining devices).

    Axes are Auto (GSPMD propagation): the model relies on sharding constraints, not explicit-sharding types.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = list(mesh_sizes(len(devices), data, fsdp, tensor, context=context).values())
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def current_mesh() -> jax.sharding.AbstractMesh | None:
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def constrain(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    """Sharding constraint by logical axes under the active mesh (`jax.set_mesh`); a no-op without one."""
    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))


def param_spec(var: nnx.Variable, mesh: Mesh | None = None) -> PartitionSpec:
    axes = var.get_metadata().get("logical_axes")
    if axes is None:
        return PartitionSpec()
    return logical_to_spec(axes, var.shape, mesh)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """The NamedSharding of every variable in `state` (same tree), from its logical axes and the rules."""

    def one(var):
        return var.replace(NamedSharding(mesh, param_spec(var, mesh)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_sharded(constructor: Callable[[], nnx.Module], mesh: Mesh | None) -> nnx.Module:
    """Build a module with every parameter created directly in its sharded layout (never whole on one device)."""
    # Always under jit, also without a mesh: one compiled program instead of many eager ops, and values
    # bit-identical whatever the mesh (threefry is partitionable, so sharding does not change the draws).
    graphdef, abstract_state = nnx.split(nnx.eval_shape(constructor))
    if mesh is None:
        return nnx.merge(graphdef, jax.jit(lambda: nnx.state(constructor()))())
    shardings = state_shardings(abstract_state, mesh)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda: nnx.state(constructor()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def init_model(cfg, mesh: Mesh | None, seed: int = 0):
    """A randomly initialized Transformer (HF-style normal(0.02) weights, unit norms), sharded by the rules."""
    from primejax.models.transformer import Transformer

    return create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)), mesh)
