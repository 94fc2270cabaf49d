"""Packed causal GQA attention on TPU: Pallas splash attention with segment ids, sharded by the mesh rules.

The splash kernel (`jax.experimental.pallas.ops.tpu.splash_attention`) takes `SegmentIds` natively, and
its block-sparse causal mask skips every block above the diagonal, so packed rows cost what their causal
triangle costs and nothing is O(T^2) in memory. Its layout is per head: the MQA variant attends `group`
query heads to one k/v head, so the call is vmapped over rows and kv heads (no k/v repeat for GQA).

A Pallas kernel is an opaque custom call to XLA's SPMD partitioner: left alone inside a sharded program
it would run on whole (gathered) operands on every device. Under a mesh the kernel therefore runs in
`shard_map`, rows split like the activations' `batch` axis and heads over `tensor` x `context` when the kv
heads divide it (then the query heads of one kv head stay on one device), else over `tensor` alone when they
divide that; otherwise the heads are left whole on each device, which is correct but does the tensor-parallel
(and context-parallel) group's attention redundantly.

The kernel needs the sequence in whole blocks: rows are padded to a multiple of 128 with a segment id no
token has (-1), and the padding's outputs are cut off. Its residuals (output and logsumexp) are checkpoint-
named `RESIDUALS`, so the "attn" remat policies keep them instead of re-running the forward kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from primejax.models.sharding import current_mesh, logical_to_spec, mesh_axes

RESIDUALS = "splash_residuals"  # checkpoint name of the kernel's saved forward results
_ALIGN = 128  # the kernel's smallest block: rows are padded to a multiple of it


def _block(t: int) -> int:
    return next(b for b in (512, 256, _ALIGN) if t % b == 0)


def _kernel(t: int, group: int, interpret: bool):
    """The kernel for rows of `t` tokens, made per call: its block-mask tables are arrays, so a kernel kept
    across traces would carry one trace's values into the next (and is typed on the mesh it was made under).
    The costly part, the mask analysis, is cached inside jax's splash module."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b = _block(t)
    sizes = sk.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(group)])
    return sk.make_splash_mqa_single_device(
        mask, block_sizes=sizes, residual_checkpoint_name=RESIDUALS, interpret=interpret
    )


def _local(q, k, v, segment_ids, scale: float, interpret: bool):
    """The kernel on this device's rows and heads: q [B, T, H, Dh], k/v [B, T, K, Dh], segment_ids [B, T]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, t, h, d = q.shape
    kv = k.shape[2]
    tp = -(-t // _ALIGN) * _ALIGN
    if tp != t:
        pad = [(0, 0), (0, tp - t), (0, 0), (0, 0)]
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, [(0, 0), (0, tp - t)], constant_values=-1)
    kernel = _kernel(tp, h // kv, interpret)
    # The kernel takes pre-scaled queries; [B, K, G, T, Dh] puts each kv head's query group together.
    q_bkgtd = (q * jnp.asarray(scale, q.dtype)).reshape(b, tp, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    k_bktd = k.transpose(0, 2, 1, 3)
    v_bktd = v.transpose(0, 2, 1, 3)

    def per_row(q_kgtd, k_ktd, v_ktd, seg_t):
        seg = sk.SegmentIds(q=seg_t, kv=seg_t)
        return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=seg))(q_kgtd, k_ktd, v_ktd)

    o_bkgtd = jax.vmap(per_row)(q_bkgtd, k_bktd, v_bktd, segment_ids)
    return o_bkgtd.transpose(0, 3, 1, 2, 4).reshape(b, tp, h, d)[:, :t].astype(q.dtype)


def head_axes(num_kv_heads: int, mesh) -> tuple[str, ...] | None:
    """The mesh axes the kernel splits heads over: `tensor` x `context` when the kv heads divide it (the
    layout `context_parallel.to_heads` leaves q, k, v in), else `tensor` when they divide that, else none.

    Heads not split over `context` mean every device of a context group runs its rows' attention in full:
    correct, but C times the work and a gather of the heads the all-to-all had split.
    """
    axes = tuple(a for a in mesh_axes("attn_kv_heads") if mesh.shape.get(a, 1) > 1)
    while axes and num_kv_heads % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    return axes or None


def splash_attention(q, k, v, segment_ids, scale: float, *, interpret: bool = False) -> jax.Array:
    """Packed causal attention (see attention.attention): on this device, or in shard_map under a mesh."""
    run = functools.partial(_local, scale=scale, interpret=interpret)
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        return run(q, k, v, segment_ids)
    rows = logical_to_spec(("batch",), segment_ids.shape[:1], mesh)[0]
    heads = head_axes(k.shape[2], mesh)
    qkv = PartitionSpec(rows, None, heads, None)
    return jax.shard_map(
        run, in_specs=(qkv, qkv, qkv, PartitionSpec(rows, None)), out_specs=qkv, check_vma=False
    )(q, k, v, segment_ids)
