"""LM head + target logprob + entropy with a hand-written backward: one fp32 pass per chunk each way.

Same function as `logprobs.token_logprobs` (chunked over positions, never a full [T, V] fp32 logits array),
but where autodiff of the chunked log-softmax keeps several fp32 [chunk, V] temporaries alive and runs the two
backward matmuls on fp32 cotangents, the custom VJP here:

- forward: per chunk, logits = h @ W (bf16 operands, fp32 accumulation), then lse, the target logit and
  sum(p * z) from that one logits block in two reads (`_lse_and_entropy`); only lse and the entropy
  ([T] each) are kept for the backward;
- backward: per chunk, recompute the logits once, form d logits in fp32 in one elementwise pass,
      d z_j = g_lp * (1[j = y] - p_j) - g_ent * p_j * (log p_j + H),   z = logits / temperature,
  cast it to the compute dtype and feed both matmuls (dh = dlogits @ W^T, dW += h^T @ dlogits) in bf16 with
  fp32 accumulation; dW accumulates in fp32 across chunks.

The matmuls therefore run at bf16 tensor-core rate and each [chunk, V] block is written and read about three
times in total instead of many. The gradient matches the autodiff path to bf16 rounding of d logits
(tests/perf/test_fast_paths.py).

When memory allows (`saved_logits_max_bytes`), the head runs as one block and the forward keeps its fp32
logits for the backward: the recompute matmul goes (2·T·D·V FLOPs) for the fp32 logits plus their bf16
gradient held at once, 6 bytes per logit (15 GB at 16k tokens and a 152k vocabulary); docs/benchmarks.md
has the measured trade. The saved logits are the ones the recompute would produce, so
values and gradients are those of the recomputing head.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from primejax.models.precision import accumulating_einsum, accumulation_dtype


def _logits(h_bkd, w_dv, tau_bk):
    acc = accumulation_dtype(h_bkd.dtype)
    z = accumulating_einsum("bkd,dv->bkv", h_bkd, w_dv, acc)
    return z / tau_bk[..., None].astype(acc)


def _lse_and_entropy(z):
    """(logsumexp, entropy) over the last axis in two reads of `z`: its max, then both sums at once.

    With m = max z, s = sum e^(z-m) and u = sum e^(z-m) z: lse = m + log s and H = lse - u / s. The two
    sums read the same operand with the same shape, so XLA emits them as one multi-output reduction; the
    textbook order (lse first, then sum p z) needs a third full read of the fp32 logits, the largest
    array of the step (10 GB per 16k-token row at Qwen3's 152k vocabulary).
    """
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    e = jnp.exp(z - m)
    s = jnp.sum(e, axis=-1)
    u = jnp.sum(e * z, axis=-1)
    lse = m[..., 0] + jnp.log(s)
    return lse, lse - u / s


def _chunk_forward(h_bkd, w_c, y_bk, tau_bk):
    """((logprob, entropy, lse), fp32 logits) of one chunk; `w_c` already in the compute dtype."""
    z = _logits(h_bkd, w_c, tau_bk)
    lse, ent = _lse_and_entropy(z)
    z_y = jnp.take_along_axis(z, y_bk[..., None], axis=-1)[..., 0]
    return (z_y - lse, ent, lse), z


def _forward(h_cbkd, w_dv, y_cbk, tau_cbk):
    w_c = w_dv.astype(h_cbkd.dtype)  # cast once, outside the chunk loop

    def chunk(_, xs):
        h, y, tau = xs
        return None, _chunk_forward(h, w_c, y, tau)[0]  # the logits stay inside the loop body

    _, (lp, ent, lse) = jax.lax.scan(chunk, None, (h_cbkd, y_cbk, tau_cbk))
    return lp, ent, lse


def _dlogits(z, y, tau, lse, ent, g_lp, g_ent, cdt):
    """d loss / d (h @ W) for one chunk, in the compute dtype, from its fp32 logits `z` (already / tau)."""
    acc = z.dtype
    logp = z - lse[..., None]
    p = jnp.exp(logp)
    onehot = jnp.arange(z.shape[-1], dtype=y.dtype) == y[..., None]
    dz = g_lp[..., None] * (onehot.astype(acc) - p) - g_ent[..., None] * p * (logp + ent[..., None])
    return (dz / tau[..., None].astype(acc)).astype(cdt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _head(h_cbkd, w_dv, y_cbk, tau_cbk, save_logits):
    lp, ent, _ = _forward(h_cbkd, w_dv, y_cbk, tau_cbk)
    return lp, ent


def _head_fwd(h_cbkd, w_dv, y_cbk, tau_cbk, save_logits):
    if not save_logits:
        lp, ent, lse = _forward(h_cbkd, w_dv, y_cbk, tau_cbk)
        return (lp, ent), (h_cbkd, w_dv, y_cbk, tau_cbk, lse, ent, None)
    # One block (the caller made a single chunk): a chunk loop would copy each block's logits into a
    # stacked residual, an extra write and read of the largest array of the step.
    (lp, ent, lse), z = _chunk_forward(h_cbkd[0], w_dv.astype(h_cbkd.dtype), y_cbk[0], tau_cbk[0])
    return (lp[None], ent[None]), (h_cbkd, w_dv, y_cbk, tau_cbk, lse[None], ent[None], z)


def _head_bwd(save_logits, res, cts):
    h_cbkd, w_dv, y_cbk, tau_cbk, lse_cbk, ent_cbk, saved_z = res
    g_lp_cbk, g_ent_cbk = cts
    cdt = h_cbkd.dtype
    acc = accumulation_dtype(cdt)
    w_c = w_dv.astype(cdt)

    def chunk(dw_dv, xs):
        h, y, tau, lse, ent, g_lp, g_ent, z = xs
        z = _logits(h, w_c, tau) if z is None else z
        dlogits = _dlogits(z, y, tau, lse, ent, g_lp.astype(acc), g_ent.astype(acc), cdt)
        dh = accumulating_einsum("bkv,dv->bkd", dlogits, w_c, acc).astype(cdt)
        dw_dv = dw_dv + accumulating_einsum("bkd,bkv->dv", h, dlogits, acc)
        return dw_dv, dh

    dw0 = jnp.zeros(w_dv.shape, acc)
    xs = (h_cbkd, y_cbk, tau_cbk, lse_cbk, ent_cbk, g_lp_cbk, g_ent_cbk)
    if saved_z is not None:
        dw_dv, dh = chunk(dw0, (*(x[0] for x in xs), saved_z))
        return dh[None], dw_dv.astype(w_dv.dtype), None, None
    dw_dv, dh_cbkd = jax.lax.scan(lambda c, x: chunk(c, (*x, None)), dw0, xs)
    return dh_cbkd, dw_dv.astype(w_dv.dtype), None, None


_head.defvjp(_head_fwd, _head_bwd)


def fused_token_logprobs(
    hidden_btd: jax.Array,
    lm_head_dv: jax.Array,
    targets_bt: jax.Array,
    temperatures_bt: jax.Array,
    chunk_size: int = 1024,
    saved_logits_max_bytes: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """(logprobs, entropy), fp32 [B, T]; drop-in for `logprobs.token_logprobs` with a fused backward.

    Temperatures get no gradient (they are data). T is padded up to a multiple of the chunk; the padding is
    computed and dropped. When the whole head fits in `saved_logits_max_bytes` (fp32 logits and their bf16
    gradient, `saved_logits_bytes`), it runs as one block that keeps its logits for the backward instead
    of recomputing them.
    """
    b, t, _ = hidden_btd.shape
    save = 0 < saved_logits_bytes(b * t, lm_head_dv.shape[-1], hidden_btd.dtype) <= saved_logits_max_bytes
    (h_cbkd, y_cbk, tau_cbk), merge = split_into_chunks(
        hidden_btd, targets_bt, temperatures_bt, t if save else chunk_size
    )
    lp, ent = _head(h_cbkd, lm_head_dv, y_cbk, tau_cbk, save)
    return merge(lp), merge(ent)


def saved_logits_bytes(tokens: int, vocab: int, compute_dtype) -> int:
    """Memory the head holds at once when it keeps its logits: fp32 logits plus their gradient."""
    acc = accumulation_dtype(compute_dtype)
    return tokens * vocab * (jnp.dtype(acc).itemsize + jnp.dtype(compute_dtype).itemsize)


def split_into_chunks(
    hidden_btd: jax.Array, targets_bt: jax.Array, temperatures_bt: jax.Array, chunk_size: int
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], Callable[[jax.Array], jax.Array]]:
    """[B, T, ...] -> [C, B, K, ...] chunks of K positions (T padded up to C*K), and `merge` back to [B, T].

    The batch axis stays inside each chunk, so data-parallel sharding of the rows is untouched. Padding has
    temperature 1 and target 0; it is computed and dropped by `merge`.
    """
    b, t, _ = hidden_btd.shape
    chunk = max(1, min(chunk_size, t))
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        hidden_btd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
        targets_bt = jnp.pad(targets_bt, ((0, 0), (0, pad)))
        temperatures_bt = jnp.pad(temperatures_bt, ((0, 0), (0, pad)), constant_values=1.0)

    def split(x: jax.Array) -> jax.Array:
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    def merge(x: jax.Array) -> jax.Array:
        return jnp.moveaxis(x, 0, 1).reshape(b, n * chunk)[:, :t]

    return (split(hidden_btd), split(targets_bt), split(temperatures_bt)), merge


__all__ = ["fused_token_logprobs", "saved_logits_bytes", "split_into_chunks"]
