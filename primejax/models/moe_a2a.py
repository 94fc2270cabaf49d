"""Expert parallelism by all-to-all token exchange (ModelConfig.expert_parallel = "a2a"; docs/moe.md).

Per device, inside the shard_map of moe.experts_forward (tokens split over every batch axis, experts over the
`experts` axis of sharding.SHARDING_RULES, P devices along it, E_local = E / P experts each):

1. sort the local (token, expert) pairs by expert: since experts are laid out by device, that also sorts them
   by destination device; each pair's row is its token's hidden state (moe._dispatch);
2. dispatch: send each peer the rows of the pairs routed to its experts, with their expert ids;
3. sort the received rows by local expert and run the expert MLP (grouped matmul) on the local experts only;
4. combine: send the outputs back the way they came, and weight each token's k outputs by its scores.

Dropless and exact, in rounds. A device sends one peer at most C = N * min(k, E_local) rows (each token routes
at most min(k, E_local) of its k pairs to one peer's experts). Each round gives every peer a slot of c rows
(`capacity`: ModelConfig.a2a_capacity_factor x the balanced share N * k / P, or C when the factor is <= 0):
round r carries rows [r*c, (r+1)*c) of what a device sends each peer. Round 0 always runs; round r > 0 runs
only when some device sends some peer more than r*c rows (all devices see the same all-gathered counts, so all
take the same branch), and its backward recomputes it under the same condition rather than keeping its
buffers (`_round_if`). With a balanced load one round of c ~ 1.5 N*k/P rows moves min(k, E_local) * P / 1.5k
times fewer rows than worst-case slots (2.7x at P = 4 for Qwen3-30B-A3B). The receive buffer of a round holds
P * c rows: slot s from device s. Two exchanges (ModelConfig.a2a_impl):

- "padded": `jax.lax.all_to_all` of the [P, c, D] send buffer (unused rows zero). Any backend.
- "ragged": `jax.lax.ragged_all_to_all` sends exactly the rows of the round into the same slots. XLA:CPU has
  no ragged-all-to-all (its ThunkEmitter refuses the opcode); on GPU (jax 0.11.2) it ran ~10x slower than
  "padded" (docs/benchmarks.md), so this is the TPU path.
- "auto": ragged on TPU (the mesh's platform: an ahead-of-time TPU compile on a CPU host takes it), padded
  elsewhere.

Both fill the same slots, and the expert MLP sorts its rows by expert, so they give the same result. Memory per
device and sparse layer: a round's receive buffer and the MLP's rows, P * c * (D + 2I) elements, and under
"padded" the send buffer too. The MLP runs over ranges of N*k/2 rows of the sorted receive buffer, each skipped
(lax.cond) when it holds no received row, so its FLOPs follow the rows received (about N * k when the load is
balanced), not the buffer: the Mosaic GPU grouped matmul's work is set by its static row count. Each range is
a kernel to compile, so rounds past the first run as one range.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from primejax.models import moe
from primejax.models.config import A2A_IMPLS

# The ragged exchange; tests/models/moe_mesh_check.py swaps in a stand-in built from all_to_all to run the
# ragged path's offset arithmetic on XLA:CPU, which lacks the collective.
RAGGED_ALL_TO_ALL = jax.lax.ragged_all_to_all


def resolve_a2a(impl: str) -> str:
    if impl not in A2A_IMPLS:
        raise ValueError(f"a2a_impl={impl!r} is not one of {A2A_IMPLS}")
    if impl == "auto":
        # the mesh's platform first: a step compiled ahead of time for TPU on a CPU host takes the TPU path. On
        # GPU (jax 0.11.2) ragged_all_to_all ran ~10x slower than the padded exchange (docs/benchmarks.md).
        from primejax.models.attention import _mesh_platform

        return "ragged" if (_mesh_platform() or jax.default_backend()) == "tpu" else "padded"
    return impl


@jax.custom_vjp
def _gather_rows(x, idx, valid, inv_idx, inv_valid):
    """y[j] = x[idx[j]] where valid[j], else 0; every row of x lands in y at most once, at inv_idx (where
    inv_valid), so the gradient is the gather g[inv_idx] (XLA's transpose would be a scatter-add)."""
    y = jnp.take(x, jnp.clip(idx, 0, x.shape[0] - 1), axis=0)
    return jnp.where(valid[:, None], y, jnp.zeros_like(y))


def _gather_rows_fwd(x, idx, valid, inv_idx, inv_valid):
    return _gather_rows(x, idx, valid, inv_idx, inv_valid), (idx, valid, inv_idx, inv_valid)


def _gather_rows_bwd(res, g):
    idx, valid, inv_idx, inv_valid = res
    return _gather_rows(g, inv_idx, inv_valid, idx, valid), None, None, None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _chunked_mlp(rows, group_sizes, gate_up, down, adapters, *, impl, lora_scale, size):
    """moe._expert_mlp over row ranges of `size` rows of `rows` (sorted by expert, received rows first; the last
    range may be shorter), each run only when it holds a grouped row: the work follows the rows received, not
    the buffer size. Each range is its own grouped-matmul call (a kernel to compile): keep them few."""
    m, d = rows.shape
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    total = ends[-1]
    outs = []
    for lo in range(0, m, size):
        hi = min(lo + size, m)
        sizes_c = (jnp.clip(ends, lo, hi) - jnp.clip(starts, lo, hi)).astype(jnp.int32)

        def run(x, sizes_c=sizes_c):
            return moe._expert_mlp(
                x, sizes_c, gate_up, down, adapters, impl=impl, full=False, lora_scale=lora_scale
            )

        outs.append(jax.lax.cond(total > lo, run, jnp.zeros_like, rows[lo:hi]))
    return jnp.concatenate(outs, axis=0)


# Each round past the first is its own expert MLP and exchange in the compiled layer: at most this many rounds,
# the slots grow where the factor would take more (many devices, few local experts: P = 64, E_local = 2, k = 8
# would take 11 rounds at factor 1.5).
MAX_ROUNDS = 8


def capacity(n: int, k: int, e_local: int, p: int, factor: float) -> int:
    """Rows one peer's slot holds per round: the worst case C = N * min(k, E_local) when `factor` <= 0, else
    factor x the balanced share N * k / P rounded up to a multiple of 8, at least C / MAX_ROUNDS, at most C."""
    worst = n * min(k, e_local)
    if factor <= 0:
        return worst
    share = max(math.ceil(factor * n * k / p), -(-worst // MAX_ROUNDS))
    return min(worst, -(-share // 8) * 8)


def experts_a2a(
    x_nd, topk_idx, scores, gate_up, down, adapters=None, *, axis, impl, exchange, lora_scale, capacity_factor
):  # fmt: skip
    """One device's part of the sparse block: its tokens x [N, D] routed by topk_idx [N, k] (global expert
    ids) and scores [N, k]; gate_up / down (and adapters) are its E_local experts, the `axis` index-th block."""
    n, d = x_nd.shape
    k = topk_idx.shape[1]
    e_local = gate_up.shape[0]
    p = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    worst = n * min(k, e_local)  # the most rows one peer can be sent
    c = capacity(n, k, e_local, p, capacity_factor)
    rounds = -(-worst // c)

    key = topk_idx.reshape(-1)
    order, inv = moe._sort_pairs(key)  # by expert, hence by destination device
    xs = moe._dispatch(x_nd, order, inv, k)  # [N*k, D]
    ids = jnp.take(key, order)  # [N*k] global expert ids, sorted
    dest = ids // e_local
    send_counts = jnp.bincount(dest, length=p).astype(jnp.int32)  # rows to each peer
    send_starts = _exclusive_cumsum(send_counts)
    counts = jax.lax.all_gather(send_counts, axis)  # [source, destination], the same on every device
    pos = jnp.arange(n * k, dtype=jnp.int32) - jnp.take(send_starts, dest)  # a row's place among its peer's
    static = (p, c, axis, exchange, impl, lora_scale)
    ints = (ids, dest, pos, send_counts, send_starts, counts, me)
    ys = _round(0, static, ints, xs, gate_up, down, adapters)
    most = jnp.max(counts)
    for r in range(1, rounds):  # only when some device sends some peer more than r * c rows: all agree
        ys = ys + _round_if(r, static, most > r * c, ints, xs, gate_up, down, adapters)
    return moe._combine(ys, order, inv, scores)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _round_if(r, static, pred, ints, xs, gate_up, down, adapters):
    """`_round` when `pred` (the same on every device), else zeros. Its backward recomputes the round (under
    the same condition) instead of keeping its buffers: differentiating a lax.cond would make every round's
    buffers residuals, so rounds that almost never run would cost their memory in every layer's backward."""
    run = lambda: _round(r, static, ints, xs, gate_up, down, adapters)  # noqa: E731
    return jax.lax.cond(pred, run, lambda: jnp.zeros_like(xs))


def _round_if_fwd(r, static, pred, ints, xs, gate_up, down, adapters):
    return _round_if(r, static, pred, ints, xs, gate_up, down, adapters), (pred, ints, xs, gate_up, down, adapters)


def _round_if_bwd(r, static, res, g):
    pred, ints, *diff = res

    def grads():
        fn = lambda *d: _round(r, static, ints, *d)  # noqa: E731
        return jax.vjp(fn, *diff)[1](g)

    zeros = lambda: tuple(jax.tree.map(jnp.zeros_like, d) for d in diff)  # noqa: E731
    return (None, None, *jax.lax.cond(pred, grads, zeros))


_round_if.defvjp(_round_if_fwd, _round_if_bwd)


def _round(r, static, ints, xs, gate_up, down, adapters):
    """Rows [r*c, (r+1)*c) of what this device sends each peer, there and back: [N*k, D] with the expert MLP's
    output at those rows (in the sorted pairs' order) and zero elsewhere. Peer q's rows land in slot q of
    every receive buffer ([P * c] rows, slot s from device s)."""
    p, c, axis, exchange, impl, lora_scale = static
    ids, dest, pos, send_counts, send_starts, counts, me = ints
    nk, d = xs.shape
    lo = r * c
    j = jnp.arange(c, dtype=jnp.int32)
    sizes = jnp.clip(send_counts - lo, 0, c)  # rows to each peer this round
    recv_sizes = jnp.clip(counts[:, me] - lo, 0, c)  # rows from each source
    mine = (pos >= lo) & (pos < lo + c)
    slot = dest * c + pos - lo  # where a row of this round sits in the send buffer
    src = (send_starts[:, None] + lo + j[None, :]).reshape(-1)  # the row each send slot holds
    valid = (j[None, :] < sizes[:, None]).reshape(-1)
    if exchange == "padded":
        send = _gather_rows(xs, src, valid, slot, mine)  # [P * c, D]
        send_ids = jnp.where(valid, jnp.take(ids, jnp.clip(src, 0, nk - 1)), -1)
        recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)
        recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0, tiled=True)
    else:
        offsets = jnp.where(sizes > 0, send_starts + lo, 0)
        lands = jnp.full((p,), me * c, jnp.int32)  # my slot in every peer's buffer
        recv = RAGGED_ALL_TO_ALL(xs, jnp.zeros((p * c, d), xs.dtype), offsets, sizes, lands, recv_sizes, axis_name=axis)
        recv_ids = RAGGED_ALL_TO_ALL(
            ids[:, None], jnp.full((p * c, 1), -1, ids.dtype), offsets, sizes, lands, recv_sizes, axis_name=axis
        )[:, 0]  # fmt: skip

    e_local = gate_up.shape[0]
    local = recv_ids - me * e_local
    lkey = jnp.where((local >= 0) & (local < e_local), local, e_local)  # empty rows sort last
    order2, inv2 = moe._sort_pairs(lkey)
    group_sizes = jnp.bincount(lkey, length=e_local + 1)[:e_local].astype(jnp.int32)
    rows = moe._permute(recv, order2, inv2)
    # Ranges of N*k / 2 rows, half of what a device receives with a balanced load: then the first two run and
    # the rest of the buffer is skipped. Rounds past the first run rarely and whole (one range: one kernel to compile).
    size = -(-nk // 2) if r == 0 else p * c
    y = _chunked_mlp(rows, group_sizes, gate_up, down, adapters, impl=impl, lora_scale=lora_scale, size=size)
    y_recv = moe._permute(y, inv2, order2)

    if exchange == "padded":
        back = jax.lax.all_to_all(y_recv, axis, 0, 0, tiled=True)
        return _gather_rows(back, slot, mine, src, valid)
    # back where each source holds my rows: its send_starts toward me, plus this round's offset
    back_at = jnp.where(recv_sizes > 0, _exclusive_cumsum(counts, axis=1)[:, me] + lo, 0)
    slots_at = jnp.arange(p, dtype=jnp.int32) * c
    return RAGGED_ALL_TO_ALL(
        y_recv, jnp.zeros((nk, d), y_recv.dtype), slots_at, recv_sizes, back_at, sizes, axis_name=axis
    )


def ragged_all_to_all_reference(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all`'s documented semantics from all_to_all, gathers and a scatter (one slice
    per peer), for meshes whose backend lacks the collective (XLA:CPU). Differentiable by jax's own rules."""
    rows = operand.shape[0]
    j = jnp.arange(rows, dtype=jnp.int32)
    src = input_offsets[:, None] + j[None, :]  # [P, rows]
    valid = j[None, :] < send_sizes[:, None]
    chunks = jnp.take(operand, jnp.clip(src, 0, rows - 1).reshape(-1), axis=0)  # [P * rows, ...]
    chunks = jnp.where(valid.reshape(-1, *[1] * (operand.ndim - 1)), chunks, 0)
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # source-major blocks of `rows`
    lands = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source's slice goes
    pos = lands[:, None] + j[None, :]
    pos = jnp.where(j[None, :] < recv_sizes[:, None], pos, output.shape[0])  # out of range: dropped
    return output.at[pos.reshape(-1)].set(got, mode="drop")
