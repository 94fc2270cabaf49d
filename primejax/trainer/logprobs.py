"""Target-token logprobs and entropies from hidden states, without materializing [tokens, vocab] fp32 logits.

With a 150k vocabulary a 64k-token row has ~40 GB of fp32 logits, so the trainer's head (`token_logprobs`,
implemented in fused_head.py) runs over chunks of positions with a hand-written backward, and keeps a
micro-batch's fp32 logits for that backward only when they fit the `saved_logits_max_bytes` budget
(`saved_logits_max_bytes()` turns `trainer.lm_head_saved_logits_gib` into it); otherwise the backward
recomputes each chunk's logits. Under context parallelism each device's share of a row is a row of its own
(`fold_context`). The batch dimension is never chunked, so data-parallel sharding of the rows is untouched.

`token_logprobs_autodiff` (chunks under `jax.checkpoint`, autodiff backward) and `token_logprobs_reference`
(full logits) are the versions tests compare it against. Matmuls run in the hidden states' dtype with fp32
accumulation; temperature scaling, log-softmax and entropy run in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from primejax.models.context_parallel import fold_context, unfold_context
from primejax.models.precision import accumulating_einsum, accumulation_dtype
from primejax.trainer.fused_head import fused_token_logprobs, split_into_chunks

# "auto" budget for the head's saved logits: a quarter of the memory JAX's allocator may use on the device
# (`bytes_limit`), leaving the rest to the state and activations: keeping the logits removes the head's
# recompute matmul, but only a budget that leaves the step room to fit is a gain (docs/benchmarks.md).
AUTO_SAVED_LOGITS_FRACTION = 0.25


def saved_logits_max_bytes(gib: float, device: jax.Device | None = None) -> int:
    """Per-device byte budget for the head's saved logits from `trainer.lm_head_saved_logits_gib`.

    -1 = auto: `AUTO_SAVED_LOGITS_FRACTION` of the device's allocator limit where the runtime reports it (GPU, TPU),
    0 (always recompute) where it does not (CPU, whose memory the host's other processes share).
    """
    if gib >= 0:
        return int(gib * 2**30)
    stats = (device or jax.local_devices()[0]).memory_stats() or {}
    return int(AUTO_SAVED_LOGITS_FRACTION * stats.get("bytes_limit", 0))


def _chunk_stats(
    h_btd: jax.Array, w_dv: jax.Array, targets_bt: jax.Array, temps_bt: jax.Array
) -> tuple[jax.Array, jax.Array]:
    acc = accumulation_dtype(h_btd.dtype)
    logits_btv = accumulating_einsum("btd,dv->btv", h_btd, w_dv.astype(h_btd.dtype), acc)
    logits_btv = logits_btv / temps_bt[..., None].astype(acc)
    lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    target_logit_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
    logprobs_bt = target_logit_bt - lse_bt
    # H = lse - sum_v p_v z_v; computed from the same logits so it costs no extra matmul.
    probs_btv = jnp.exp(logits_btv - lse_bt[..., None])
    entropy_bt = lse_bt - jnp.sum(probs_btv * logits_btv, axis=-1)
    return logprobs_bt, entropy_bt


def token_logprobs(
    hidden_btd: jax.Array,
    lm_head_dv: jax.Array,
    targets_bt: jax.Array,
    temperatures_bt: jax.Array,
    chunk_size: int = 1024,
    saved_logits_max_bytes: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """(logprobs, entropy), both fp32 [B, T]: log softmax(h @ W / temp)[target] and the entropy of that softmax.

    The trainer's head: the same chunking with a hand-written backward (`fused_head`), which keeps the
    backward matmuls in the compute dtype (bf16 tensor-core rate; docs/benchmarks.md measures it).
    `saved_logits_max_bytes`: keep the fp32 logits for the backward instead of recomputing them when they
    fit (see `fused_head.fused_token_logprobs`).
    `token_logprobs_autodiff` is the autodiff version it is tested against.
    """
    t = hidden_btd.shape[1]
    # Under context parallelism each device's tokens of a row become a row of their own, so the chunk loop
    # runs over local tokens only (a loop over the split token axis would run every chunk everywhere).
    lp, ent = fused_token_logprobs(
        fold_context(hidden_btd),
        lm_head_dv,
        fold_context(targets_bt),
        fold_context(temperatures_bt),
        chunk_size,
        saved_logits_max_bytes,
    )
    return unfold_context(lp, t), unfold_context(ent, t)


def token_logprobs_autodiff(
    hidden_btd: jax.Array,
    lm_head_dv: jax.Array,
    targets_bt: jax.Array,
    temperatures_bt: jax.Array,
    chunk_size: int = 1024,
) -> tuple[jax.Array, jax.Array]:
    """(logprobs, entropy), both fp32 [B, T]: log softmax(h @ W / temp)[target] and the entropy of that softmax.

    `chunk_size` positions are processed at a time; T is padded up to a multiple of it (the padding is
    computed and dropped).
    """
    (h_cbkd, y_cbk, tau_cbk), merge = split_into_chunks(hidden_btd, targets_bt, temperatures_bt, chunk_size)
    body = jax.checkpoint(lambda h, y, tau: _chunk_stats(h, lm_head_dv, y, tau))
    if h_cbkd.shape[0] == 1:
        lp, ent = body(h_cbkd[0], y_cbk[0], tau_cbk[0])
        return merge(lp[None]), merge(ent[None])

    def step(
        carry: None, xs: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[None, tuple[jax.Array, jax.Array]]:
        return carry, body(*xs)

    _, (lp_cbk, ent_cbk) = jax.lax.scan(step, None, (h_cbkd, y_cbk, tau_cbk))
    return merge(lp_cbk), merge(ent_cbk)


def token_logprobs_reference(
    hidden_btd: jax.Array, lm_head_dv: jax.Array, targets_bt: jax.Array, temperatures_bt: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The naive version (full [B, T, V] logits), for tests."""
    acc = accumulation_dtype(hidden_btd.dtype)
    logits = accumulating_einsum("btd,dv->btv", hidden_btd, lm_head_dv.astype(hidden_btd.dtype), acc)
    logits = logits / temperatures_bt[..., None].astype(acc)
    logp = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.take_along_axis(logp, targets_bt[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return lp, ent
