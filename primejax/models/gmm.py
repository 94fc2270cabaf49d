"""Grouped matmul for the experts: rows of `lhs` sorted by group, each group times its own weight matrix.

    grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]
    out[r] = lhs[r] @ rhs[g(r)], rows of group g the g-th run of group_sizes[g] rows; rows past
    sum(group_sizes) come out zero.

Two implementations with one contract:
- "xla": `jax.lax.ragged_dot` (portable; XLA:CPU and TPU run it as a grouped matmul). On Hopper (jax 0.11.2)
  XLA lowers it to dense masked matmuls: 5-24 TFLOP/s at Qwen3-30B-A3B shapes and its backward runs out of
  memory at 16k tokens x top-8, so it is the reference, not the GPU path.
- "mgpu": the Pallas Mosaic-GPU kernels shipped with JAX (`jax.experimental.pallas.ops.gpu`): `ragged_dot`
  for the forward and the input gradient (rhs transposed), `transposed_ragged_dot` for the weight gradient,
  tied together in one `custom_vjp`. Hopper only; shapes must tile (K, N multiples of the block sizes).
  The kernels leave rows past sum(group_sizes) unwritten (whatever the buffer held, NaN included); a select
  zeroes them in the output, the output gradient and the input gradient. The weight gradient's kernel masks a
  block's rows of other groups by a product, so those rows must reach it finite: the selects see to it (a
  zero-weight padding group did this before: a copy of the weights per call, 68 ms per step and GPU in the
  4-GPU all-to-all trace, docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

IMPLS = ("xla", "mgpu", "auto")


def resolve_impl(impl: str) -> str:
    """ "auto": mgpu on a Hopper GPU (compute capability 9.0), xla elsewhere."""
    if impl != "auto":
        return impl
    dev = jax.devices()[0]
    if dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0":
        return "mgpu"
    return "xla"


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    impl: str = "xla",
    *,
    all_rows_grouped: bool = False,
) -> jax.Array:
    """[M, K] x [G, K, N] by row groups -> [M, N] in lhs.dtype (fp32 accumulation).

    `all_rows_grouped` (static): the caller guarantees sum(group_sizes) == M, so the mgpu path needs no select
    to zero the rows past the groups.
    """
    if impl not in IMPLS:
        raise ValueError(f"grouped matmul impl {impl!r} is not one of {IMPLS}")
    impl = resolve_impl(impl)
    group_sizes = group_sizes.astype(jnp.int32)
    if impl == "xla":
        return jax.lax.ragged_dot(
            lhs, rhs.astype(lhs.dtype), group_sizes, preferred_element_type=jnp.float32
        ).astype(lhs.dtype)
    return _mgpu_gmm(lhs, rhs.astype(lhs.dtype), group_sizes, not all_rows_grouped)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def adapter_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    impl: str = "xla",
    *,
    all_rows_grouped: bool = False,
) -> jax.Array:
    """grouped_matmul for a rank-r LoRA factor (K or N is the rank), with the experts' own implementation.

    XLA's ragged_dot is dense on Hopper (module docstring): at Qwen3-30B-A3B's shapes the expert adapters' backward
    asked for 527 GiB. The Mosaic kernels need K and N to tile, so on "mgpu" the rank dimension is zero-padded to
    a multiple of ADAPTER_TILE (zero rows/columns add nothing to the product; the pad's gradient is sliced
    away): a rank-16 factor then costs what a rank-128 one would, a few percent of the expert matmuls.
    """
    impl = resolve_impl(impl)
    if impl != "mgpu":
        return grouped_matmul(lhs, rhs, group_sizes, impl, all_rows_grouped=all_rows_grouped)
    rhs_n = rhs.shape[2]
    lhs, rhs = pad_to_tiles(lhs, rhs, ADAPTER_TILE)
    out = grouped_matmul(lhs, rhs, group_sizes, "mgpu", all_rows_grouped=all_rows_grouped)
    return out[:, :rhs_n]


def pad_to_tiles(lhs: jax.Array, rhs: jax.Array, tile: int) -> tuple[jax.Array, jax.Array]:
    """lhs [M, K] and rhs [G, K, N] zero-padded so K and N are multiples of `tile` (the product's first N
    columns are unchanged)."""
    _, k, n = rhs.shape
    kp, np_ = _round_up(k, tile), _round_up(n, tile)
    if kp != k:
        lhs = jnp.pad(lhs, ((0, 0), (0, kp - k)))
    return lhs, jnp.pad(rhs, ((0, 0), (0, kp - k), (0, np_ - n)))


# ---------------------------------------------------------------------- Mosaic GPU (Hopper)


# Tile sizes per kernel and shape. Keys: (op, contracting dim, output dim) with op "fwd" (lhs [M, K] @ rhs
# [G, K, N] -> [M, N]), "dlhs" (dout [M, N] @ rhs^T -> [M, K]: contracting N, output K) and "wgrad" (lhs^T @ dout
# -> [G, K, N]: keyed by K, N). Values: the kernels' tile arguments. Shapes not in the table use DEFAULT_TILES
# (128 x 128 x 64, 4 pipeline stages: fits shared memory for bf16 at any shape that tiles). MEASURED_TILES holds
# the fastest of a sweep at Qwen3-30B-A3B's expert shapes (tools/bench_moe.py --suite tiles, docs/benchmarks.md).
def _tiles(bm: int, bn: int, bk: int = 64, stages: int = 4, gbn: int = 1) -> dict[str, int]:
    return dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=stages, grid_block_n=gbn)


DEFAULT_TILES = _tiles(128, 128)
ADAPTER_TILE = 128  # a LoRA factor's rank dimension is padded to this on mgpu (adapter_grouped_matmul)


# Qwen3-30B-A3B's expert shapes (16k tokens x top-8 rows over 128 experts): per kernel, the fastest tile sizes of
# a sweep on an H100 whose outputs equal the default tiles' (each beat DEFAULT_TILES; docs/moe.md has the sweep).
MEASURED_TILES: dict[tuple[str, int, int], dict[str, int]] = {
    ("fwd", 2048, 1536): _tiles(128, 192, gbn=4),  # gate_up forward
    ("dlhs", 1536, 2048): _tiles(192, 128, gbn=4),  # gate_up input grad
    ("wgrad", 2048, 1536): _tiles(128, 192),  # gate_up weight grad
    ("fwd", 768, 2048): _tiles(192, 128, gbn=4),  # down forward
    ("dlhs", 2048, 768): _tiles(128, 192, gbn=4),  # down input grad
    ("wgrad", 768, 2048): _tiles(192, 128),  # down weight grad
}


def tiles_for(op: str, k: int, n: int) -> dict[str, int]:
    """The tile arguments used for kernel `op` contracting `k` into `n` outputs (see MEASURED_TILES)."""
    key = (op, k, n)
    return dict(MEASURED_TILES.get(key) or DEFAULT_TILES)


def _zero_past_groups(x, group_sizes):
    """x [M, ...] with the rows past sum(group_sizes) zero: the kernels leave them unwritten. A select, not a
    product, so whatever they held (NaN too) is dropped; XLA fuses it into the consumer."""
    rows = jnp.arange(x.shape[0], dtype=jnp.int32).reshape(-1, *[1] * (x.ndim - 1))
    return jnp.where(rows < jnp.sum(group_sizes), x, jnp.zeros((), x.dtype))


def _fwd_kernel(lhs, rhs, group_sizes, transpose_rhs: bool):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    k, n = rhs.shape[1:]
    tiles = tiles_for("dlhs", n, k) if transpose_rhs else tiles_for("fwd", k, n)
    return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes, transpose_rhs=transpose_rhs, **tiles)


def _wgrad_kernel(lhs_mk, dout_mn, group_sizes):
    """Per-group lhs^T @ dout: [G, K, N]."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    tiles = tiles_for("wgrad", lhs_mk.shape[1], dout_mn.shape[1])
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(lhs_mk, dout_mn, group_sizes=group_sizes, **tiles)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mgpu_gmm(lhs, rhs, group_sizes, partial: bool):
    """`partial`: rows may lie past the groups (zeroed here; see the module docstring)."""
    out = _fwd_kernel(lhs, rhs, group_sizes, transpose_rhs=False)
    return _zero_past_groups(out, group_sizes) if partial else out


def _mgpu_fwd(lhs, rhs, group_sizes, partial):
    return _mgpu_gmm(lhs, rhs, group_sizes, partial), (lhs, rhs, group_sizes)


def _mgpu_bwd(partial, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    if partial:  # the output's rows past the groups are constant: no gradient reaches the kernel through them
        dout = _zero_past_groups(dout, group_sizes)
    # d lhs = dout @ rhs[g]^T: the forward kernel with the weights read transposed ([G, K, N] as N x K tiles).
    dlhs = _fwd_kernel(dout, rhs, group_sizes, transpose_rhs=True)
    drhs = _wgrad_kernel(lhs, dout, group_sizes)
    return (_zero_past_groups(dlhs, group_sizes) if partial else dlhs), drhs.astype(rhs.dtype), None


_mgpu_gmm.defvjp(_mgpu_fwd, _mgpu_bwd)


@functools.cache
def mgpu_available() -> bool:
    return resolve_impl("auto") == "mgpu"


# The experts' SwiGLU over rows grouped by expert, which both of moe.py's exchanges and moe_a2a.py's run.
# Checkpoint names of the grouped matmuls' outputs: remat policies that keep the weight matmuls' outputs keep
# these too (remat._saves_attention_and_weight_dots); the kernels are custom calls, not dot_general, so
# jax's dots policies alone would re-run them in the backward pass.
GMM_OUTPUTS = ("moe_gate_up", "moe_down")


def sort_pairs(key):
    """(order, inv): the stable sort of the pairs by `key` and its inverse permutation."""
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    inv = (
        jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32), unique_indices=True)
    )
    return order, inv


def expert_mlp(xs, group_sizes, gate_up, down, adapters=None, *, impl, full, lora_scale):
    """SwiGLU of rows sorted by expert (group_sizes [E_local]) -> [rows, D]; rows past the groups come out zero.

    `full` (static): every row belongs to a group (models/gmm.py `all_rows_grouped`).
    """
    e_local, d, _, i = gate_up.shape
    h = grouped_matmul(xs, gate_up.reshape(e_local, d, 2 * i), group_sizes, impl, all_rows_grouped=full)
    if adapters is not None:
        h = h + _expert_gate_up_delta(xs, adapters, group_sizes, lora_scale, impl, full)
    h = checkpoint_name(h, GMM_OUTPUTS[0])
    a = jax.nn.silu(h[:, :i]) * h[:, i:]
    ys = grouped_matmul(a, down, group_sizes, impl, all_rows_grouped=full)  # [rows, D]
    if adapters is not None:
        _, _, a_down, b_down = adapters
        t = adapter_grouped_matmul(a, a_down, group_sizes, impl, all_rows_grouped=full)
        t = t * jnp.asarray(lora_scale, a.dtype)
        ys = ys + adapter_grouped_matmul(t, b_down, group_sizes, impl, all_rows_grouped=full)
    return checkpoint_name(ys, GMM_OUTPUTS[1])


def _expert_gate_up_delta(xs, adapters, group_sizes, scale, impl, full):
    """[N*k, 2I]: each pair's gate and up adapters' s·(x·A)·B, laid out like the fused gate_up output."""
    a_gu, b_gu, _, _ = adapters
    e, d, two, r = a_gu.shape
    gmm = functools.partial(adapter_grouped_matmul, group_sizes=group_sizes, impl=impl, all_rows_grouped=full)
    t = gmm(xs, a_gu.reshape(e, d, two * r)) * jnp.asarray(scale, xs.dtype)
    return jnp.concatenate([gmm(t[:, c * r : (c + 1) * r], b_gu[:, c]) for c in range(two)], axis=-1)
