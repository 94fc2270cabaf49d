"""Expert parallelism by all-to-all token exchange (ModelConfig.expert_parallel = "a2a"; docs/moe.md).

Per device, inside the shard_map of moe.experts_forward (tokens split over every batch axis, experts over the
`experts` axis of sharding.SHARDING_RULES, P devices along it, E_local = E / P experts each):

1. sort the local (token, expert) pairs by expert: since experts are laid out by device, that also sorts them
   by destination device; each pair's row is its token's hidden state (moe._dispatch);
2. dispatch: send each peer the rows of the pairs routed to its experts, with their expert ids;
3. sort the received rows by local expert and run the expert MLP (grouped matmul) on the local experts only;
4. combine: send the outputs back the way they came, and weight each token's k outputs by its scores.

Dropless: no capacity; every buffer is sized for the worst case that routing allows. A device sends one peer
at most C = N * min(k, E_local) rows (each token routes at most min(k, E_local) of its k pairs to one peer's
experts), so the receive buffer holds P * C rows whatever the routing. Two exchanges (ModelConfig.a2a_impl):

- "ragged": `jax.lax.ragged_all_to_all` sends exactly the routed rows (N*k rows of D per device and
  direction, as many back) into the worst-case receive buffer. XLA:CPU has no ragged-all-to-all (its
  ThunkEmitter refuses the opcode), so this is the GPU/TPU path.
- "padded": `jax.lax.all_to_all` of a [P, C, D] buffer per device (each peer's slot sized for the worst case,
  unused rows zero): P * C * D elements each way, min(k, E_local) * P / k times the routed rows. Portable (the
  CPU path; the tests' reference).
- "auto": padded on CPU, ragged elsewhere (the mesh's platform: an ahead-of-time TPU compile on a CPU host
  takes ragged).

Both build the same receive layout up to where the rows sit, and the expert MLP sorts its rows by expert, so
they give the same result. Memory per device and sparse layer (worst-case buffers): the receive buffer and
the MLP's rows P * C * (D + 2I) elements, and under "padded" the [P, C, D] send buffer too. The MLP runs in
chunks of the receive buffer, each skipped (lax.cond) when it holds no received row, so its FLOPs follow the
rows actually received (about N * k when the load is balanced), not the worst case; the Mosaic GPU grouped
matmul's work is set by its static row count, so without the chunks it would do P * min(k, E_local) / k
times the work.
"""

from __future__ import annotations

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
        # the mesh's platform first: a step compiled ahead of time for TPU on a CPU host takes the TPU path
        from primejax.models.attention import _mesh_platform

        return "padded" if (_mesh_platform() or jax.default_backend()) == "cpu" else "ragged"
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


def _chunked_mlp(rows, group_sizes, gate_up, down, adapters, *, impl, lora_scale, chunks):
    """moe._expert_mlp over `chunks` equal row ranges of `rows` (sorted by expert, received rows first), each
    range run only when it holds a grouped row: the work follows the rows received, not the buffer size."""
    m, d = rows.shape
    size = m // chunks
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    total = ends[-1]
    outs = []
    for c in range(chunks):
        lo, hi = c * size, (c + 1) * size
        sizes_c = (jnp.clip(ends, lo, hi) - jnp.clip(starts, lo, hi)).astype(jnp.int32)

        def run(x, sizes_c=sizes_c):
            return moe._expert_mlp(
                x, sizes_c, gate_up, down, adapters, impl=impl, full=False, lora_scale=lora_scale
            )

        outs.append(jax.lax.cond(total > lo, run, jnp.zeros_like, rows[lo:hi]))
    return jnp.concatenate(outs, axis=0)


def experts_a2a(x_nd, topk_idx, scores, gate_up, down, adapters=None, *, axis, impl, exchange, lora_scale):
    """One device's part of the sparse block: its tokens x [N, D] routed by topk_idx [N, k] (global expert
    ids) and scores [N, k]; gate_up / down (and adapters) are its E_local experts, the `axis` index-th block."""
    n, d = x_nd.shape
    k = topk_idx.shape[1]
    e_local = gate_up.shape[0]
    p = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    cap = n * min(k, e_local)  # the most rows one peer can be sent
    recv_rows = p * cap

    key = topk_idx.reshape(-1)
    order, inv = moe._sort_pairs(key)  # by expert, hence by destination device
    xs = moe._dispatch(x_nd, order, inv, k)  # [N*k, D]
    ids = jnp.take(key, order)  # [N*k] global expert ids, sorted
    dest = ids // e_local
    send_counts = jnp.bincount(dest, length=p).astype(jnp.int32)  # rows to each peer
    send_starts = _exclusive_cumsum(send_counts)
    counts = jax.lax.all_gather(send_counts, axis)  # [source, destination]
    recv_counts = counts[:, me]

    if exchange == "padded":
        # slot (q, j) of the send buffer holds the row send_starts[q] + j; row r sits in slot (dest, r - start)
        j = jnp.arange(cap, dtype=jnp.int32)
        src = (send_starts[:, None] + j[None, :]).reshape(-1)
        valid = (j[None, :] < send_counts[:, None]).reshape(-1)
        slot = dest * cap + jnp.arange(n * k, dtype=jnp.int32) - jnp.take(send_starts, dest)
        every = jnp.ones((n * k,), bool)
        send = _gather_rows(xs, src, valid, slot, every)  # [P * C, D]
        send_ids = jnp.where(valid, jnp.take(ids, jnp.clip(src, 0, n * k - 1)), -1)
        recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)
        recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0, tiled=True)
    else:
        # where each source's rows start in each destination's receive buffer: sources in order
        land = _exclusive_cumsum(counts, axis=0)  # [source, destination]
        recv_starts = land[:, me]
        back_starts = _exclusive_cumsum(counts, axis=1)[:, me]  # where my rows sat in each source's buffer
        recv = RAGGED_ALL_TO_ALL(
            xs, jnp.zeros((recv_rows, d), xs.dtype), send_starts, send_counts, land[me], recv_counts,
            axis_name=axis,
        )  # fmt: skip
        recv_ids = RAGGED_ALL_TO_ALL(
            ids[:, None], jnp.full((recv_rows, 1), -1, ids.dtype), send_starts, send_counts, land[me],
            recv_counts, axis_name=axis,
        )[:, 0]  # fmt: skip

    local = recv_ids - me * e_local
    lkey = jnp.where((local >= 0) & (local < e_local), local, e_local)  # empty rows sort last
    order2, inv2 = moe._sort_pairs(lkey)
    group_sizes = jnp.bincount(lkey, length=e_local + 1)[:e_local].astype(jnp.int32)
    rows = moe._permute(recv, order2, inv2)
    chunks = 2 * p if cap % 2 == 0 else p
    y = _chunked_mlp(
        rows, group_sizes, gate_up, down, adapters, impl=impl, lora_scale=lora_scale, chunks=chunks
    )
    y_recv = moe._permute(y, inv2, order2)

    if exchange == "padded":
        back = jax.lax.all_to_all(y_recv, axis, 0, 0, tiled=True)
        ys = _gather_rows(back, slot, every, src, valid)  # [N*k, D] in the sorted pairs' order
    else:
        ys = RAGGED_ALL_TO_ALL(
            y_recv, jnp.zeros((n * k, d), y_recv.dtype), recv_starts, recv_counts, back_starts, send_counts,
            axis_name=axis,
        )  # fmt: skip
    return moe._combine(ys, order, inv, scores)


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
