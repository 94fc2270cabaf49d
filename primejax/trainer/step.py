"""One optimizer step over a step's micro-batches: the step's math, unjitted (trainer/engine.py compiles it).

The step's batch arrives as [M, R, T] arrays (M micro-batches of R packed rows). Before the micro-batch loop
the step counts every loss component's member tokens over the whole step (N_c, see losses.py), then a
`lax.scan` over the micro-batches accumulates fp32 gradients of each micro-batch's already-normalized loss
share; the sum is therefore exactly the gradient of the step's loss, whatever M is. Then the global-norm
clip + AdamW update, guarded against non-finite values (the update is skipped and `nonfinite` = 1).

The state lives in fp32 (master weights, `model.param_dtype`), the model casts to its compute dtype inside
(bf16 by default); the remat policy and the attention kernel are model config. Rows are sharded like the
logical `batch` axis (models/sharding.py); parameters by the model's sharding rules. The state is donated, and everything returned
is an array (metrics included), so the host never waits inside a step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from primejax.contracts.batch import FIELDS, PackedBatch
from primejax.models.lora import join_params
from primejax.models.moe import max_violation
from primejax.models.sharding import axis_size, mesh_axes, spec_entry
from primejax.trainer.corrections import CorrectionTable, merge_sums, step_norms
from primejax.trainer.logprobs import token_logprobs
from primejax.trainer.losses import LossConfig, finalize_metrics, global_counts, make_loss_fn, member_masks


@struct.dataclass
class TrainState:
    params: Any  # nested dict of arrays (nnx.to_pure_dict of the model state)
    opt_state: Any
    step: jax.Array  # int32: optimizer steps taken
    rng: jax.Array  # uint32 key data; reserved for stochastic layers, carried and checkpointed


def init_state(
    model: nnx.Module | dict, optimizer: optax.GradientTransformation, seed: int = 0, mesh: Mesh | None = None
) -> TrainState:
    """Fresh state from the model's parameters (or the trained ones as a pure dict: LoRA's adapters). With a
    mesh (default: the parameters' own, if they have one) every leaf gets a NamedSharding on it, the layout the
    jitted step returns (see shard_state)."""
    params = model if isinstance(model, dict) else nnx.to_pure_dict(nnx.state(model))
    if mesh is None:
        meshes = [x.sharding.mesh for x in jax.tree.leaves(params) if isinstance(x.sharding, NamedSharding)]
        mesh = meshes[0] if meshes else None
    if mesh is None:
        opt_state = jax.jit(optimizer.init)(params)
    else:
        opt_state = jax.jit(optimizer.init, out_shardings=opt_state_shardings(optimizer, params, mesh))(
            params
        )
    state = TrainState(params, opt_state, jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(seed)))
    return state if mesh is None else shard_state(state, mesh)


def opt_state_shardings(optimizer: optax.GradientTransformation, params: Any, mesh: Mesh) -> Any:
    """Every parameter-shaped part of the optimizer state (AdamW's moments) sharded like its parameter.

    `jax.jit(optimizer.init)` alone leaves them replicated: `zeros_like` has no data dependence on the
    parameter, so nothing propagates its sharding, and each device would hold all of both fp32 moments
    (8 bytes per parameter; 65 GB for an 8B model). Scalars (the step count) are replicated.
    `params` may be arrays or ShapeDtypeStructs carrying their shardings.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    shape = jax.eval_shape(optimizer.init, params)
    param_sh = jax.tree.map(lambda p: leaf_sharding(p, mesh), params)
    return optax.tree_map_params(
        optimizer, lambda _, sh: sh, shape, param_sh, transform_non_params=lambda _: replicated
    )


def shift_targets(mb: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Align the streams with the hidden states: position t predicts token t + 1.

    The batch stores streams per target token (contracts.batch); here every stream moves one step left, so
    index t of the result is about the token predicted from hidden state t. The last position predicts
    nothing (loss_mask False). A segment's first token is never trained, so no loss crosses segments.
    """
    targets = _shift_left(mb["tokens"], 0)
    streams = {
        k: _shift_left(mb[k], 1.0 if k == "temperatures" else 0)
        for k in FIELDS
        if k not in ("tokens", "positions")
    }
    return targets, streams


def _shift_left(x: jax.Array, fill: Any) -> jax.Array:
    """x[:, t + 1] at position t (axis 1), `fill` at the last position."""
    return jnp.concatenate([x[:, 1:], jnp.full_like(x[:, :1], fill)], axis=1)


def replay_inputs(mb: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array] | None:
    """The model's `replay` (experts [B, T, Ls, k] int32, mask [B, T]) from a batch's routed experts, or None.

    The batch keeps them per target token (contracts.batch); the model wants each position's own routing, so
    both move one step left like every stream (`shift_targets`): position t gets the routing recorded for the
    token it predicts, which the sampler computed at that same position.
    """
    if "routed_experts" not in mb:
        return None
    return _shift_left(mb["routed_experts"], 0).astype(jnp.int32), _shift_left(mb["routed_mask"], False)


def tree_all_finite(tree: Any) -> jax.Array:
    """One scalar: whether every floating-point leaf of `tree` is finite everywhere."""
    leaves = [
        jnp.isfinite(x).all()
        for x in jax.tree.leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def _tree_where(pred: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


GUARDS = ("fused", "select")


def guarded_update(
    optimizer: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    finite: jax.Array,
    guard: str = "fused",
) -> tuple[Any, Any, jax.Array]:
    """(params, opt_state, ok) after one optimizer update, or the inputs unchanged where the update is not
    finite: ok = `finite` (loss and gradient) & every new parameter and optimizer-state leaf finite.

    "select" computes and writes the new state, reduces it, then selects new vs old: over parameters and both
    AdamW moments that is ~19 full passes of memory (update 7, check 3, select 9). "fused" gives the same
    result in ~12: a first pass computes the update only to reduce it to the predicate (nothing written), then
    the update runs again with the select inside its elementwise fusion (read 4, write 3). The optimization
    barrier keeps XLA from merging the two computations back into one materialized update.
    """

    def new_state(g, s, p):
        updates, s2 = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), s2

    p1, s1 = new_state(grads, opt_state, params)
    ok = finite & tree_all_finite(p1) & tree_all_finite(s1)
    if guard == "select":
        return _tree_where(ok, p1, params), _tree_where(ok, s1, opt_state), ok
    if guard != "fused":
        raise ValueError(f"guard {guard!r} is not one of {GUARDS}")
    grads, opt_state, params, ok = jax.lax.optimization_barrier((grads, opt_state, params, ok))
    p2, s2 = new_state(grads, opt_state, params)
    return _tree_where(ok, p2, params), _tree_where(ok, s2, opt_state), ok


def _forward(graphdef, params, mb, chunk_size, max_segments, saved_logits_max_bytes):
    """(target logprobs, entropies, shifted streams, MoE stats) of one micro-batch."""
    model = nnx.merge(graphdef, params)
    hidden_btd, moe_stats = model.forward_with_aux(
        mb["tokens"],
        mb["positions"],
        mb["segment_ids"],
        max_segments=max_segments or None,
        replay=replay_inputs(mb),
    )
    targets, streams = shift_targets(mb)
    lp, ent = token_logprobs(
        hidden_btd,
        model.lm_head_weight(),
        targets,
        streams["temperatures"],
        chunk_size,
        saved_logits_max_bytes,
    )
    return lp, ent, streams, moe_stats


def _micro_loss_fn(
    graphdef: nnx.GraphDef,
    loss_fn: Callable,
    chunk_size: int,
    max_segments: int,
    saved_logits_max_bytes: int,
    loss_cfg: LossConfig | None = None,
) -> Callable:
    def micro_loss(params, mb, counts, micro_share=1.0, frozen=None):
        # LoRA: `params` are the adapters (the only differentiated argument), `frozen` the rest of the model
        whole = params if frozen is None else join_params(params, frozen)
        lp, ent, streams, moe_stats = _forward(
            graphdef, whole, mb, chunk_size, max_segments, saved_logits_max_bytes
        )
        loss, sums = loss_fn(lp, ent, streams, counts)
        if moe_stats:
            loss, sums = _add_moe_terms(loss, sums, moe_stats, loss_cfg or LossConfig(), micro_share)
        return loss, sums

    return micro_loss


def _norm_prepass(
    graphdef, table: CorrectionTable, chunk_size, max_segments, saved_logits_max_bytes
) -> Callable:
    """The whole step's IS-weight sums (corrections.step_norms) from a forward-only pass over its micro-batches:
    a normalized weight needs them before the first micro-batch's gradient (docs/algorithms.md#corrections)."""

    def prepass(params, batch):
        def one(mb):
            lp, _, streams, _ = _forward(
                graphdef, params, mb, chunk_size, max_segments, saved_logits_max_bytes
            )
            return step_norms(jax.lax.stop_gradient(lp), streams, member_masks(streams)["rl"], table)

        per_micro = jax.lax.map(one, batch)
        return {k: jnp.sum(v, axis=0) for k, v in per_micro.items()}

    return prepass


def _add_moe_terms(loss, sums, stats, loss_cfg: LossConfig, micro_share):
    """MoE auxiliary losses (off unless configured) and routing statistics of one micro-batch.

    `micro_share` = 1 / micro-batches: the step's auxiliary loss and MaxViolation are micro-batch means
    (MaxViolation is defined per micro-batch); the expert load is summed over the step for the histograms.
    """
    lb = jnp.mean(stats["lb_loss"]) * micro_share
    z = jnp.mean(stats["z_loss"]) * micro_share
    if loss_cfg.moe_aux_coef:
        loss = loss + loss_cfg.moe_aux_coef * lb
    if loss_cfg.moe_z_coef:
        loss = loss + loss_cfg.moe_z_coef * z
    sums = dict(sums)
    sums["moe/lb_loss"] = lb
    sums["moe/z_loss"] = z
    sums["moe/max_violation"] = max_violation(stats["load"]) * micro_share  # [Ls]
    sums["moe/load"] = stats["load"]  # [Ls, E]
    return loss, sums


def make_grad_fn(
    graphdef: nnx.GraphDef,
    loss_cfg: LossConfig,
    *,
    chunk_size: int = 1024,
    max_segments: int = 0,
    saved_logits_max_bytes: int = 0,
    corrections: CorrectionTable | None = None,
) -> Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, Any, dict[str, jax.Array], dict[str, jax.Array]]]:
    """accumulate(params, batch[M, R, T], frozen=None) -> (loss, fp32 grads, metric sums, component counts) of
    the whole step; gradients of `params` only (with LoRA, `frozen` holds the model's other weights).

    `max_segments` (static, 0 = unknown) bounds the samples packed in one row: the custom loss iterates over
    them and the attention kernel sizes its per-row work by it (see `max_segments_bucket`).
    `saved_logits_max_bytes`: the LM head keeps a micro-batch's fp32 logits for the backward pass when they
    fit in this many bytes, instead of recomputing them (`logprobs.token_logprobs`).
    `corrections`: the rl loss's off-policy corrections per environment (trainer/corrections.py).
    """
    table = corrections or CorrectionTable()
    prepass = (
        _norm_prepass(graphdef, table, chunk_size, max_segments, saved_logits_max_bytes)
        if table.needs_norm
        else None
    )
    micro_loss = _micro_loss_fn(
        graphdef,
        make_loss_fn(loss_cfg, max_segments, table),
        chunk_size,
        max_segments,
        saved_logits_max_bytes,
        loss_cfg,
    )
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def accumulate(params, batch, frozen=None):
        _, whole = shift_targets({k: batch[k].reshape(-1, batch[k].shape[-1]) for k in FIELDS})
        counts = global_counts(whole)
        if prepass is not None:
            counts.update(prepass(params if frozen is None else join_params(params, frozen), batch))
        if jax.tree.leaves(batch)[0].shape[0] == 1:
            # One micro-batch: no fp32 accumulator to zero and add into (a full extra copy of the
            # parameters, ~2.4 GB for a 0.6B model, live through the backward pass).
            (loss, sums), grads = grad_fn(params, jax.tree.map(lambda v: v[0], batch), counts, 1.0, frozen)
            return loss, jax.tree.map(lambda g: g.astype(jnp.float32), grads), sums, counts

        share = 1.0 / jax.tree.leaves(batch)[0].shape[0]

        def body(carry, mb):
            grads_acc, loss_acc, sums_acc = carry
            (loss, sums), grads = grad_fn(params, mb, counts, share, frozen)
            grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
            return (grads_acc, loss_acc + loss, merge_sums(sums_acc, sums)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        first = jax.tree.map(lambda v: v[0], batch)
        sums_shape = jax.eval_shape(lambda: micro_loss(params, first, counts, share, frozen)[1])
        # max/ sums start at 0 too: the values they hold (IS weights) are >= 0
        sums0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
        (grads, loss, sums), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32), sums0), batch)
        return loss, grads, sums, counts

    return accumulate


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    loss_cfg: LossConfig,
    *,
    chunk_size: int = 1024,
    max_segments: int = 0,
    saved_logits_max_bytes: int = 0,
    guard: str = "fused",
    corrections: CorrectionTable | None = None,
    offload: Any = None,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """The (unjitted) step function train_step(state, batch[M, R, T], frozen=None) -> (state, metrics).

    With LoRA the state's params are the adapters and `frozen` the model's other weights (models/lora.py):
    only the adapters get gradients and optimizer state.

    `guard`: how a non-finite update is skipped (`guarded_update`; "select" is the plain reference version).
    `offload`: a `trainer.offload.Offload`: the state's opt_state (fp32 master + AdamW state) lives in host
    memory and the update streams it bucket by bucket (`optimizer` is then unused: the offload holds its parts).
    """
    if guard not in GUARDS:
        raise ValueError(f"guard {guard!r} is not one of {GUARDS}")
    accumulate = make_grad_fn(
        graphdef,
        loss_cfg,
        chunk_size=chunk_size,
        max_segments=max_segments,
        saved_logits_max_bytes=saved_logits_max_bytes,
        corrections=corrections,
    )

    def train_step(
        state: TrainState, batch: dict[str, jax.Array], frozen: Any = None
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        loss, grads, sums, counts = accumulate(state.params, batch, frozen)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if offload is not None:  # fp32 gradients meet the fp32 master copy, whatever the compute copy's dtype
            params, opt_state, finite = offload.update(grads, state.opt_state, state.params, finite)
        else:
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
            # The update itself must be finite too: a finite loss and gradient can still give NaN parameters (a
            # NaN learning rate, an overflowing optimizer moment), and those must never reach an export.
            params, opt_state, finite = guarded_update(
                optimizer, grads, state.opt_state, state.params, finite, guard
            )
        new = TrainState(
            params=params,
            opt_state=opt_state,
            step=state.step + finite.astype(jnp.int32),
            rng=jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0]),
        )
        metrics = finalize_metrics(sums, counts, corrections)
        metrics.update({k: v for k, v in sums.items() if k.startswith("moe/")})  # arrays [Ls] / [Ls, E]
        metrics.update(
            loss=loss, grad_norm=grad_norm, lr=schedule(state.step), nonfinite=(~finite).astype(jnp.int32)
        )
        return new, metrics

    return train_step


def target_logprobs(model: nnx.Module, arrays: Mapping[str, jax.Array], chunk_size: int = 1024) -> jax.Array:
    """[B, T] logprob of each token given its prefix, aligned with the tokens (index t = token t as a target).

    Uses the batch temperatures; index 0 of each segment has no predictor and holds 0. This is the quantity
    the inference server reports as sampling logprobs (for tests, reference scoring and mismatch checks).
    """
    hidden_btd = model(arrays["tokens"], arrays["positions"], arrays["segment_ids"])
    targets, streams = shift_targets(arrays)
    lp, _ = token_logprobs(hidden_btd, model.lm_head_weight(), targets, streams["temperatures"], chunk_size)
    # back to "token t as target" alignment: the logprob computed at position t - 1
    lp = jnp.concatenate([jnp.zeros_like(lp[:, :1]), lp[:, :-1]], axis=1)
    starts = (arrays["positions"] == 0) | (arrays["segment_ids"] == 0)
    return jnp.where(starts, 0.0, lp)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[M, R, T] arrays: rows over the data-parallel axes, micro-batch and sequence axes whole."""
    seq = spec_entry(mesh_axes("seq")) if axis_size(mesh, "seq") > 1 else None  # context parallelism
    return NamedSharding(mesh, PartitionSpec(None, spec_entry(mesh_axes("batch")), seq))


def leaf_sharding(x: Any, mesh: Mesh) -> NamedSharding:
    """`x`'s NamedSharding where it has one on `mesh` (arrays or ShapeDtypeStructs), else replicated."""
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding) and sh.mesh.shape_tuple == mesh.shape_tuple:
        return sh
    return NamedSharding(mesh, PartitionSpec())  # created outside the mesh (scalars, RNG): replicate


def shard_state(state: TrainState, mesh: Mesh) -> TrainState:
    """Give every leaf a NamedSharding on `mesh` (unsharded leaves become replicated).

    The jitted step returns mesh shardings; feeding it the same kind avoids a second compilation.
    """
    return jax.device_put(state, jax.tree.map(lambda x: leaf_sharding(x, mesh), state))


def dp_size(mesh: Mesh) -> int:
    return axis_size(mesh, "batch")


def to_micro_batches(batch: PackedBatch, micro_batch_rows: int) -> dict[str, np.ndarray]:
    """[rows, T, ...] -> [M, micro_batch_rows, T, ...], padding with empty rows (no loss) to fill the last one."""
    rows = -(-batch.rows // micro_batch_rows) * micro_batch_rows
    batch = batch.pad_rows(rows)
    return {
        k: v.reshape(rows // micro_batch_rows, micro_batch_rows, *v.shape[1:])
        for k, v in batch.arrays().items()
    }


def max_segments_bucket(batch: PackedBatch) -> int:
    """Static bound on packed sequences per row, rounded up to a power of two to limit recompilations."""
    n = int(batch.segment_ids.max(initial=0))
    return 1 << max(0, (n - 1).bit_length())


def device_batch(arrays: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Place this process's rows as the global [M, R, T] batch (every process passes its own rank file)."""
    sh = batch_sharding(mesh)
    context = axis_size(mesh, "seq")
    t = arrays["tokens"].shape[-1]
    if t % context:
        raise ValueError(f"trainer.mesh.context={context} must divide the row length {t}")
    return {k: jax.make_array_from_process_local_data(sh, v) for k, v in arrays.items()}
