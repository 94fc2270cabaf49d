"""Expert parallelism by all-to-all token exchange (ModelConfig.expert_parallel = "a2a"; docs/moe.md).

Per device, inside the shard_map of moe.experts_forward (tokens split over every batch axis, experts over the
`experts` axis of sharding.SHARDING_RULES, P devices along it, E_local = E / P experts each):

1. dispatch: each token goes once to every device that holds at least one of its k experts, with its k expert
   ids and scores (a bundle), not once per (token, expert) pair. With Qwen3-30B-A3B on 4 devices a token's 8
   experts sit on 3.6 devices on average, so this moves 2.2x fewer rows than one per pair, and each bundle
   returns one row;
2. the receiver expands its bundles into (row, local expert) pairs, sorts them by expert, runs the expert MLP
   (grouped matmul) on its own experts and weights each row's outputs by their scores, one row per bundle;
3. combine: the rows go back the way they came, and each token sums what its devices returned.

Dropless and exact, in rounds. A device sends one peer at most N bundles (one per token). Each round gives every
peer a slot of c rows (`capacity`: ModelConfig.a2a_capacity_factor x the balanced share N * h, h the chance
that a token has an expert on a given device, or N when the factor is <= 0). Round r carries bundles
[r*c, (r+1)*c) of what a device sends each peer. Round 0 always runs; the later rounds run in a while loop for
as many rounds as the device that sends some peer the most bundles needs (all devices see the same
all-gathered counts, so all run the same rounds). With 4 devices and Qwen3-30B-A3B's routing h = 0.9, so
c = N: one round, whatever the routing.

The receiver's pairs: a device receives about N*k of them with a balanced load (at most P*c*min(k, E_local)).
Round 0 runs the expert MLP over the first `pair_window` sorted pairs (the factor x N*k), in ranges of half a
balanced load (`mlp_ranges`), each skipped (lax.cond) when it holds no pair: the Mosaic GPU grouped matmul's
work is set by its static row count, so this keeps the FLOPs to the pairs received. Every exchange waits for
the device with the most pairs (docs/moe.md has the measured skew). Pairs past the window (a skewed batch) run
a window at a time in a while loop, for as many windows as they fill. Each range is a kernel to compile, so
these windows and later rounds run as one range.

The later rounds and windows (`_loop_sum`) run in while loops, not one lax.cond each: a loop's buffers serve
every step, where each cond got buffers of its own in the TPU compile. Their backward recomputes each step
in a loop of its own instead of keeping its buffers.

Two exchanges (ModelConfig.a2a_impl):
- "padded": `jax.lax.all_to_all` of the [P, c, D] send buffer (unused rows zero). Any backend.
- "ragged": `jax.lax.ragged_all_to_all` sends only the filled rows of each slot. XLA:CPU has no
  ragged-all-to-all (its ThunkEmitter refuses the opcode); on GPU (jax 0.11.2) it ran ~10x slower than
  "padded" (docs/benchmarks.md), so this is the TPU path.
- "auto": ragged on TPU (the mesh's platform: an ahead-of-time TPU compile on a CPU host takes it), padded
  elsewhere.

Both fill the same slots, so they give the same result. Memory per device and sparse layer: the send and
receive buffers, 2 * P * c * D elements, and the window of pairs and the MLP's rows, window * (D + 2I), and
their gradients in the backward.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from primejax.models.config import A2A_IMPLS
from primejax.models.gmm import expert_mlp, sort_pairs

# The ragged exchange; tests/models/moe_mesh_check.py swaps in a stand-in built from all_to_all to run the
# ragged path's offset arithmetic on XLA:CPU, which lacks the collective.
RAGGED_ALL_TO_ALL = jax.lax.ragged_all_to_all

# checkpoint_name of round 0's received bundles (rows, expert ids, scores): a remat policy that saves them
# (ModelConfig.keep_exchanged_tokens) leaves the backward's recompute no exchange to run. (The combine is not
# recomputed either way: no backward needs its output.)
EXCHANGED = "moe_a2a_exchanged"

# Each round is an exchange on the critical path: at most this many, the slots grow where the factor would take more.
MAX_ROUNDS = 8


def resolve_a2a(impl: str) -> str:
    if impl not in A2A_IMPLS:
        raise ValueError(f"a2a_impl={impl!r} is not one of {A2A_IMPLS}")
    if impl == "auto":
        # the mesh's platform first: a step compiled ahead of time for TPU on a CPU host takes the TPU path. On
        # GPU (jax 0.11.2) ragged_all_to_all ran ~10x slower than the padded exchange (docs/benchmarks.md).
        from primejax.models.attention import _mesh_platform

        return "ragged" if (_mesh_platform() or jax.default_backend()) == "tpu" else "padded"
    return impl


def hit_fraction(k: int, e_local: int, p: int) -> float:
    """The chance that a token's k distinct experts, drawn uniformly from E = P * E_local, include one of a
    given device's E_local: the share of a device's tokens that each peer receives with a balanced load."""
    e = e_local * p
    miss = 1.0
    for i in range(k):
        if e - e_local - i <= 0:  # more experts than the other devices hold: every token visits
            return 1.0
        miss *= (e - e_local - i) / (e - i)
    return 1.0 - miss


def _round8(x: float) -> int:
    return -(-math.ceil(x) // 8) * 8


def capacity(n: int, k: int, e_local: int, p: int, factor: float) -> int:
    """Bundles one peer's slot holds per round: the worst case N when `factor` <= 0, else factor x the balanced
    share N * hit_fraction rounded up to a multiple of 8, at least N / MAX_ROUNDS, at most N."""
    if factor <= 0:
        return n
    share = max(factor * hit_fraction(k, e_local, p) * n, n / MAX_ROUNDS)
    return min(n, _round8(share))


def pair_window(n: int, k: int, e_local: int, p: int, factor: float) -> int:
    """(token, local expert) pairs an expert MLP call covers (round 0's first; more run only for a skewed batch):
    factor x N*k (what a device receives with a balanced load), at most every pair its receive buffer holds."""
    most = p * capacity(n, k, e_local, p, factor) * min(k, e_local)
    return most if factor <= 0 else min(most, _round8(factor * n * k))


class _Plan(NamedTuple):
    """One layer's static exchange plan (hashable: it rides the custom VJPs as a nondifferentiable argument)."""

    c: int  # bundles per peer per round (`capacity`)
    axis: str
    exchange: str  # "padded" or "ragged"
    impl: str  # the grouped matmul's
    lora_scale: float
    window: int  # pairs per expert MLP call (`pair_window`)
    ranges: tuple[int, ...]  # where round 0's first call's MLP ranges start (`mlp_ranges`)


def experts_a2a(
    x_nd, topk_idx, scores, gate_up, down, adapters=None, *, axis, impl, exchange, lora_scale, capacity_factor
):  # fmt: skip
    """One device's part of the sparse block: its tokens x [N, D] routed by topk_idx [N, k] (global expert
    ids) and scores [N, k]; gate_up / down (and adapters) are its E_local experts, the `axis` index-th block."""
    n, k = topk_idx.shape
    e_local = gate_up.shape[0]
    p = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    c = capacity(n, k, e_local, p, capacity_factor)
    rounds = -(-n // c)

    peers = jnp.arange(p, dtype=jnp.int32)
    hit = jnp.any(
        topk_idx[None] // e_local == peers[:, None, None], axis=-1
    )  # [P, N]: token n goes to peer q
    pos = jnp.cumsum(hit, axis=1, dtype=jnp.int32) - 1  # its place among what peer q is sent
    send_counts = jnp.sum(hit, axis=1, dtype=jnp.int32)
    counts = jax.lax.all_gather(send_counts, axis)  # [source, destination], the same on every device
    width = rounds * c
    tok_of = (  # the token at each place of each peer's list
        jnp.zeros((p, width), jnp.int32)
        .at[peers[:, None], jnp.where(hit, pos, width)]
        .set(jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (p, n)), mode="drop")
    )
    window = pair_window(n, k, e_local, p, capacity_factor)
    plan = _Plan(c, axis, exchange, impl, lora_scale, window, mlp_ranges(window, n * k))
    ints = (topk_idx, hit, pos, tok_of, send_counts, counts, me)
    y = _round(0, plan, ints, x_nd, scores, gate_up, down, adapters)
    if rounds > 1:  # only as many as some device's most bundles to one peer need (all devices agree)
        more = -(-jnp.max(counts) // c) - 1
        y = y + _loop_sum(
            functools.partial(_later_round, plan), more, ints, x_nd, scores, gate_up, down, adapters
        )
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loop_sum(fn, steps, ints, *diff):
    """The sum of fn(i, ints, *diff) over i < steps (traced, the same on every device), by a while loop: one
    step's buffers serve every step, where a lax.cond per step got buffers of its own on TPU. The backward
    recomputes each step in a loop of its own instead of keeping its buffers: work that almost never runs
    would otherwise cost its memory in every layer's backward."""
    out = jax.eval_shape(fn, 0, ints, *diff)
    body = lambda i, acc: acc + fn(i, ints, *diff)  # noqa: E731
    return jax.lax.fori_loop(0, steps, body, jnp.zeros(out.shape, out.dtype))


def _loop_sum_fwd(fn, steps, ints, *diff):
    return _loop_sum(fn, steps, ints, *diff), (steps, ints, diff)


def _loop_sum_bwd(fn, res, g):
    steps, ints, diff = res

    def body(i, acc):
        grads = jax.vjp(lambda *d: fn(i, ints, *d), *diff)[1](g)
        return jax.tree.map(jnp.add, acc, grads)

    zeros = tuple(jax.tree.map(jnp.zeros_like, d) for d in diff)
    return (None, None, *jax.lax.fori_loop(0, steps, body, zeros))


_loop_sum.defvjp(_loop_sum_fwd, _loop_sum_bwd)


def _later_round(plan, i, ints, x, scores, gate_up, down, adapters):
    return _round(i + 1, plan, ints, x, scores, gate_up, down, adapters)


def _round(r, plan: _Plan, ints, x, scores, gate_up, down, adapters):
    """Bundles [r*c, (r+1)*c) of what this device sends each peer, there and back: [N, D], each token's
    weighted expert outputs from the peers this round carried it to. Peer q's bundles land in slot q of every
    receive buffer ([P * c] rows, slot s from device s)."""
    c, axis = plan.c, plan.axis
    topk_idx, hit, pos, tok_of, send_counts, counts, me = ints
    p = hit.shape[0]
    lo = r * c  # r is traced in later rounds
    src = jax.lax.dynamic_slice_in_dim(tok_of, lo, c, axis=1)  # [P, c]: the token each send slot holds
    valid = (lo + jnp.arange(c, dtype=jnp.int32))[None, :] < send_counts[:, None]
    slot = pos - lo  # [P, N]: where token n sits in peer q's slot, when this round carries it there
    here = hit & (slot >= 0) & (slot < c)
    send = _to_slots(x, src, valid, slot, here)  # [P * c, D]
    send_sc = _to_slots(scores, src, valid, slot, here)
    send_ids = jnp.where(valid.reshape(-1, 1), jnp.take(topk_idx, src.reshape(-1), axis=0), -1)
    if plan.exchange == "padded":
        there = functools.partial(jax.lax.all_to_all, axis_name=axis, split_axis=0, concat_axis=0, tiled=True)
        back = there
    else:
        starts = jnp.arange(p, dtype=jnp.int32) * c
        lands = jnp.full((p,), me * c, jnp.int32)  # my slot in every peer's buffer
        sizes = jnp.clip(send_counts - lo, 0, c)  # bundles to each peer this round
        recv_sizes = jnp.clip(counts[:, me] - lo, 0, c)  # from each source
        ragged = lambda v, n_out, m_in: RAGGED_ALL_TO_ALL(  # noqa: E731
            v, jnp.zeros_like(v), starts, n_out, lands, m_in, axis_name=axis
        )
        there = lambda v: ragged(v, sizes, recv_sizes)  # noqa: E731
        back = lambda v: ragged(v, recv_sizes, sizes)  # noqa: E731
    # empty slots: ids -1 (no local expert) under either exchange
    recv_ids = there(send_ids + 1) - 1
    first = isinstance(r, int) and r == 0
    got = (recv_ids, there(send), there(send_sc))
    if first:
        got = tuple(checkpoint_name(v, EXCHANGED) for v in got)
    return _from_slots(
        back(_received(first, plan, *got, me, gate_up, down, adapters)), slot, here, src, valid
    )


def _received(first, plan: _Plan, ids, rows, scores, me, gate_up, down, adapters):
    """The received bundles' outputs [M, D]: each row's expert MLP outputs on this device's experts, weighted by
    their scores (rows [M, D], ids and scores [M, k]; ids of other devices' experts and of empty slots are
    ignored). `first`: round 0, whose window runs in ranges (later rounds run rarely: one range, one kernel)."""
    m, k = ids.shape
    e_local = gate_up.shape[0]
    local = ids - me * e_local
    key = jnp.where((local >= 0) & (local < e_local), local, e_local).reshape(-1)  # other pairs sort last
    order, inv = sort_pairs(key)
    group_sizes = jnp.bincount(key, length=e_local + 1)[:e_local].astype(jnp.int32)
    most = m * min(k, e_local)  # every row's pairs on this device's experts (pair_window's bound)
    window = plan.window
    pairs = (order, inv, group_sizes, key < e_local)
    y = _pairs(0, window, plan.ranges if first else (0,), plan, pairs, rows, scores, gate_up, down, adapters)
    if window == most:
        return y
    # A skewed batch: the pairs past the window, a window at a time, as many windows as they fill
    steps = -(-(most - window) // window)
    order = jnp.pad(order, (0, max(window * (1 + steps) - order.shape[0], 0)))  # whole windows: none clamped
    more = jnp.maximum(jnp.sum(group_sizes) - window, 0)
    fn = functools.partial(_later_window, plan)
    pairs = (order, *pairs[1:])
    return y + _loop_sum(fn, -(-more // window), pairs, rows, scores, gate_up, down, adapters)


def _later_window(plan, i, pairs, rows, scores, gate_up, down, adapters):
    w = plan.window
    return _pairs((i + 1) * w, w, (0,), plan, pairs, rows, scores, gate_up, down, adapters)


def _pairs(lo, length, ranges, plan: _Plan, pairs, rows, scores, gate_up, down, adapters):
    """The expert outputs of the sorted pairs [lo, lo + length) (MLP ranges starting at `ranges`, relative to
    `lo`, which may be traced), weighted by their scores and summed per received row: [M, D]."""
    order, inv, group_sizes, local = pairs
    k = scores.shape[1]
    idx = jax.lax.dynamic_slice_in_dim(order, lo, length)  # the pair at each sorted position of the window
    # each pair's place in the window (outside it: < 0 or >= length). Pairs on other devices' experts sort
    # last, some into the window: they get no place (-1), so their slots all read one cached row instead of
    # their rows' zero outputs and gradients (a row's k slots then cost about what its local pairs do)
    at = jnp.where(local, inv - lo, -1)
    xs = _expand(rows, idx, at, k)  # [length, D]
    ys = _chunked_mlp(
        xs,
        group_sizes,
        gate_up,
        down,
        adapters,
        impl=plan.impl,
        lora_scale=plan.lora_scale,
        ranges=ranges,
        base=lo,
    )
    return _weigh(ys, scores, idx, at)


def mlp_ranges(window: int, balanced: int) -> tuple[int, ...]:
    """Where round 0's expert MLP ranges start in its window of sorted pairs: every half of a `balanced` load
    (N*k pairs). A device runs the ranges its pairs reach (the kernel's work is its static row count).

    Finer ranges (7/8 of the load, then eighths) cut the grouped matmuls' time on 4 x H200 but made the step
    slower, 2,711 against 2,583 ms (docs/benchmarks.md): each range's weight gradient is a whole
    [E_local, D, 2I] and [E_local, I, D] that the backward sums, five or six per layer. One weight gradient
    over the window (commit 3405307, reverted) measured 2,623 against 2,600 ms with halves, so it is not here;
    with eighths it is unmeasured."""
    step = max(8, _round8(balanced / 2))
    return tuple(range(0, window, step))


def _chunked_mlp(rows, group_sizes, gate_up, down, adapters, *, impl, lora_scale, ranges, base):
    """gmm.expert_mlp over the ranges of `rows` (the sorted pairs [base, base + len(rows))) that start at
    `ranges`, each run only when it holds a grouped row: the work follows the pairs received, not the buffer
    size. Each range is its own grouped-matmul call (one kernel per range size to compile)."""
    m = rows.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    total = ends[-1]
    outs = []
    for lo, hi in zip(ranges, (*ranges[1:], m), strict=True):
        sizes_c = (jnp.clip(ends, base + lo, base + hi) - jnp.clip(starts, base + lo, base + hi)).astype(
            jnp.int32
        )

        def run(x, sizes_c=sizes_c):
            return expert_mlp(
                x, sizes_c, gate_up, down, adapters, impl=impl, full=False, lora_scale=lora_scale
            )

        outs.append(jax.lax.cond(total > base + lo, run, jnp.zeros_like, rows[lo:hi]))
    return jnp.concatenate(outs, axis=0)


def _in(at, size):
    return (at >= 0) & (at < size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _expand(rows, idx, at, k):
    """rows[idx // k]: the received row of each pair of a window ([M, D] -> [len(idx), D]). A row feeds up to k
    pairs, so its gradient sums theirs, read through `at` (each pair's place in the window) one slot at a time:
    no [M * k, D] buffer, and no scatter-add (atomics on GPU) as XLA's transpose of the gather would be."""
    return jnp.take(rows, idx // k, axis=0)


def _expand_fwd(rows, idx, at, k):
    return _expand(rows, idx, at, k), (idx, at)


def _expand_bwd(k, res, g):
    _, at = res
    at = at.reshape(-1, k)
    acc = jnp.zeros((at.shape[0], g.shape[1]), jnp.float32)
    for j in range(k):
        a = at[:, j]
        got = jnp.take(g, jnp.clip(a, 0, g.shape[0] - 1), axis=0)
        acc = acc + jnp.where(_in(a, g.shape[0])[:, None], got.astype(jnp.float32), 0.0)
    return acc.astype(g.dtype), None, None


_expand.defvjp(_expand_fwd, _expand_bwd)


@jax.custom_vjp
def _weigh(ys, scores, idx, at):
    """out[m] = sum_j scores[m, j] * ys[at[m*k + j]] over the pairs in the window ([W, D] -> [M, D]), summed in
    fp32. Backward: each pair's output gradient is its row's times its score, a gather by `idx`."""
    m, k = scores.shape
    at = at.reshape(m, k)
    acc = jnp.zeros((m, ys.shape[1]), jnp.float32)
    for j in range(k):
        got = jnp.take(ys, jnp.clip(at[:, j], 0, ys.shape[0] - 1), axis=0).astype(jnp.float32)
        w = jnp.where(_in(at[:, j], ys.shape[0]), scores[:, j].astype(jnp.float32), 0.0)
        acc = acc + got * w[:, None]
    return acc.astype(ys.dtype)


def _weigh_fwd(ys, scores, idx, at):
    return _weigh(ys, scores, idx, at), (ys, scores, idx, at)


def _weigh_bwd(res, g):
    ys, scores, idx, at = res
    m, k = scores.shape
    g_rows = jnp.take(g, idx // k, axis=0)  # [W, D]: each pair's row's gradient, in the window's order
    d_ys = g_rows * jnp.take(scores.reshape(-1), idx).astype(g.dtype)[:, None]
    # each pair's score gradient computed in the window's order (W rows read, not M * k), then put in place
    d_pair = jnp.sum(g_rows.astype(jnp.float32) * ys.astype(jnp.float32), axis=-1)
    d_sc = jnp.where(_in(at, ys.shape[0]), jnp.take(d_pair, jnp.clip(at, 0, ys.shape[0] - 1)), 0.0)
    return d_ys.astype(ys.dtype), d_sc.reshape(m, k).astype(scores.dtype), None, None


_weigh.defvjp(_weigh_fwd, _weigh_bwd)


@jax.custom_vjp
def _to_slots(x, src, valid, slot, here):
    """The send buffer: y[q*c + j] = x[src[q, j]] where valid[q, j], else 0 ([N, ...] -> [P * c, ...]). A
    token fills at most one slot per peer, at slot[q, n] (where here[q, n]): the gradient is `_from_slots`."""
    y = jnp.take(x, src.reshape(-1), axis=0)
    mask = valid.reshape(-1, *[1] * (x.ndim - 1))
    return jnp.where(mask, y, jnp.zeros_like(y))


@jax.custom_vjp
def _from_slots(b, slot, here, src, valid):
    """Each token's sum of its slots: y[n] = sum_q b[q*c + slot[q, n]] where here[q, n] ([P * c, ...] ->
    [N, ...]), summed in fp32; the transpose of `_to_slots`."""
    p, _ = slot.shape
    c = b.shape[0] // p
    acc = 0.0
    for q in range(p):
        got = jnp.take(b, q * c + jnp.clip(slot[q], 0, c - 1), axis=0).astype(jnp.float32)
        acc = acc + jnp.where(here[q].reshape(-1, *[1] * (b.ndim - 1)), got, 0.0)
    return jnp.asarray(acc).astype(b.dtype)


def _to_slots_fwd(x, src, valid, slot, here):
    return _to_slots(x, src, valid, slot, here), (src, valid, slot, here)


def _to_slots_bwd(res, g):
    src, valid, slot, here = res
    return _from_slots(g, slot, here, src, valid), None, None, None, None


def _from_slots_fwd(b, slot, here, src, valid):
    return _from_slots(b, slot, here, src, valid), (slot, here, src, valid)


def _from_slots_bwd(res, g):
    slot, here, src, valid = res
    return _to_slots(g, src, valid, slot, here), None, None, None, None


_to_slots.defvjp(_to_slots_fwd, _to_slots_bwd)
_from_slots.defvjp(_from_slots_fwd, _from_slots_bwd)


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
