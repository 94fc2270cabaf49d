"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5's hybrid stack (as transformers 5.17's
`Qwen3_5GatedDeltaNet`), with packed segments.

One layer: `in_proj_qkv` -> a short causal depthwise conv (kernel `linear_conv_kernel_dim`, SiLU) -> q, k, v
heads; beta = sigmoid(b), the log decay g = -exp(A_log) * softplus(a + dt_bias); q and k L2-normalized, q
scaled by dk^-0.5; the gated delta rule (per value head, state S [dk, dv]):

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t

then an RMSNorm per value head gated by silu(z) and `out_proj`. Query/key heads are repeated to the value
heads (head h reads key head h // (Hv / Hk)).

The rule runs in chunked form (the UT transform of the DeltaNet paper, as transformers' reference and FLA's
kernels): within a chunk of `CHUNK` tokens everything is a few [C, C] / [C, dk] matmuls and the inverse of
one unit lower triangular matrix, itself by matmuls (`unit_lower_inverse`: no LAPACK call, which deadlocks
emulated CPU meshes); what is left, the recurrence of the state across chunks, runs as a `lax.scan` (XLA, any
backend) or as the Pallas kernels of deltanet_pallas.py (GPU; `model.deltanet_impl`), which keep each head's
state on chip for the whole row.

Packed rows: a segment start resets the state and the conv's history, so each sample sees exactly what it
would see alone. In the chunked form every decay between positions i >= j is exp(cum_i - cum_j), and a reset
in (j, i] makes it zero: the intra-chunk decays are masked by "same segment", the state entering a chunk is
read only by the positions still in the segment the previous chunk ended with, and a key writes into the
state leaving the chunk only if it is in the chunk's last segment. Segments are contiguous runs of equal ids
(the trainer's packing); padding (id 0) is a segment of its own whose outputs the caller masks.

Context parallelism (a mesh whose `context` axis splits a row's tokens): the recurrence needs every earlier
token of a segment, so around it the layout switches, as softmax attention's does (models/context_parallel.py),
from "tokens split over context" to "whole rows, heads split over tensor x context" (the `linear_attn_heads`
rule), an all-to-all per tensor that XLA's SPMD partitioner derives from the sharding constraints. The switch
happens right after the fused q/k/v projection, before the short causal conv: the conv is depthwise (per
channel), so on whole rows it needs no halo of K-1 tokens from the neighbouring device, and it moves the same
data as switching after it. q and k cross at their key heads (repeated to the value heads on the device, where
the repeat is local) when tensor x context divides those, else already repeated; v, the decay g and beta at the
value heads. Each device then runs the chunk scan on whole rows for Hv / (tensor x context) value heads (the
scan never runs over a token-split dimension), and the output goes back to the token split before the gated
norm and out_proj. The projections are pinned to the token split (else XLA would gather h over the row). Sharding constraints do not change
values, so packed segments that straddle the token split need no special case. Value heads not divisible by
tensor x context are refused (one line): they would be replicated, every device running the whole recurrence.
(The alternative, rows kept split by token with each device's incoming state passed along the context axis,
serializes the devices or needs a second pass over chunk summaries; not written.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from primejax.models import deltanet_pallas
from primejax.models.context_parallel import context_size, to_tokens
from primejax.models.sharding import axis_size, constrain, current_mesh, logical_to_spec

CHUNK = 64  # tokens per chunk (transformers' and FLA's default)
_L2_EPS = 1e-6  # as transformers' l2norm (and FLA)


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)


def causal_conv(x_btc: jax.Array, w_kc: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Depthwise causal conv [B, T, ...] with kernel w [K, ...] (w[K-1] on the current token), SiLU after.

    An input from another segment counts as zero: a sample starts with the zero history it has alone. The
    channel dimensions may be one ([B, T, C]) or several ([B, T, H, dk], split by head under a mesh).
    """
    k, t = w_kc.shape[0], x_btc.shape[1]
    extra = x_btc.ndim - 2
    out = x_btc * w_kc[k - 1]
    for lag in range(1, k):
        shifted = jnp.pad(x_btc, ((0, 0), (lag, 0)) + ((0, 0),) * extra)[:, :t]
        seg = jnp.pad(segment_ids, ((0, 0), (lag, 0)), constant_values=-1)[:, :t]
        same = (seg == segment_ids).reshape(*segment_ids.shape, *(1,) * extra)
        out = out + jnp.where(same, shifted, 0).astype(x_btc.dtype) * w_kc[k - 1 - lag]
    return jax.nn.silu(out)


def unit_lower_inverse(t: jax.Array, precision=jax.lax.Precision.HIGHEST) -> jax.Array:
    """Inverse of unit lower triangular matrices [..., C, C] by matmuls only (C a power of two).

    Blocked forward substitution: the inverses of the diagonal blocks of size s give those of size 2s,
    inv([[A, 0], [M, B]]) = [[A^-1, 0], [-B^-1 M A^-1, B^-1]], from s = 1 (the unit diagonal) to C / 2.
    Not `jax.scipy.linalg.solve_triangular`: on XLA:CPU that is LAPACK's trsm, whose batched custom call
    hands chunks of its batch to the intra-op thread pool and blocks until they ran; with emulated devices
    (--xla_force_host_platform_device_count) every device runs its program on that one pool, so when each
    device's thread waits in such a solve (or in a collective for a device that does) the chunks never run
    and the step hangs at 0% CPU (docs/models.md, "Meshes" of Qwen3.5 MoE).
    """
    c = t.shape[-1]
    if c & (c - 1):
        raise ValueError(f"unit_lower_inverse needs a power-of-two size, not {c}")
    lead = t.shape[:-2]
    inv = jnp.ones((*lead, c, 1, 1), t.dtype)  # [..., C / s, s, s]: the diagonal blocks' inverses
    s = 1
    while s < c:
        a_inv, b_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]  # [..., C / 2s, s, s]
        # pair j's block below its first diagonal block: rows (2j+1)s.., columns 2js..
        pairs = t.reshape(*lead, c // (2 * s), 2, s, c // (2 * s), 2, s)[..., :, 1, :, :, 0, :]
        m = jnp.moveaxis(jnp.diagonal(pairs, axis1=-4, axis2=-2), -1, -3)  # [..., C / 2s, s, s]
        low = -jnp.einsum("...ij,...jk,...kl->...il", b_inv, m, a_inv, precision=precision)
        zero = jnp.zeros_like(low)
        top = jnp.concatenate([a_inv, zero], axis=-1)
        bottom = jnp.concatenate([low, b_inv], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)  # [..., C / 2s, 2s, 2s]
        s *= 2
    return inv.reshape(*lead, c, c)


def resolve_impl(impl: str, chunk: int = CHUNK, dk: int = 128, dv: int = 128) -> str:
    """ "auto": the Pallas kernels on an NVIDIA GPU of compute capability 8.0 or newer (their TF32 dots need
    Ampere; measured on Hopper) when they can tile the heads, the XLA scan elsewhere."""
    if impl != "auto":
        return impl
    if not deltanet_pallas.tileable(chunk, dk, dv):
        return "xla"
    dev = jax.devices()[0]
    try:
        capability = float(getattr(dev, "compute_capability", "0") or 0)
    except ValueError:  # not a CUDA device (ROCm reports an architecture name)
        capability = 0.0
    return "pallas" if dev.platform == "gpu" and capability >= 8.0 else "xla"


def _recurrence(impl: str):
    """The chunk recurrence [B*H, N, ...] -> [B*H, N, C, dv] (deltanet_pallas.py) for `impl`:
    "xla", "pallas" (GPU), or "pallas_interpret" (the kernels interpreted, any backend; tests)."""
    if impl == "xla":
        return deltanet_pallas.chunk_recurrence_xla
    return functools.partial(
        deltanet_pallas.chunk_recurrence, precision=_precision(impl), interpret=impl == "pallas_interpret"
    )


def _precision(impl: str):
    """The fp32 matmuls' precision: TF32 x 3 with the GPU kernels (three tensor-core passes, about fp32's
    accuracy), HIGHEST otherwise (the XLA path everywhere, and the interpreted kernels: no TF32 on CPU)."""
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if impl == "pallas" else jax.lax.Precision.HIGHEST


def gated_delta_rule(q, k, v, g, beta, segment_ids, chunk: int = CHUNK, impl: str = "xla") -> jax.Array:
    """Chunked gated delta rule over packed rows.

    q, k [B, T, H, dk] (already L2-normalized and q scaled), v [B, T, H, dv], g (log decay, <= 0) and beta
    [B, T, H], segment_ids [B, T]. All math in fp32; returns [B, T, H, dv] float32. `impl` runs the recurrence
    over chunks (see `_recurrence`); under a mesh the Pallas kernels run per device in a shard_map.
    """
    impl = resolve_impl(impl, chunk, k.shape[-1], v.shape[-1])
    mesh = current_mesh()
    local = functools.partial(_chunked_rule, chunk=chunk, impl=impl)
    if impl == "xla" or mesh is None or mesh.size == 1:
        return local(q, k, v, g, beta, segment_ids)
    # a Pallas call is opaque to XLA's partitioner: run it per device on the rows and heads the device holds
    rows = logical_to_spec(("batch",), segment_ids.shape[:1], mesh)[0]
    heads = logical_to_spec((None, None, "linear_attn_heads"), q.shape[:3], mesh)[2]
    spec = PartitionSpec(rows, None, heads)
    return jax.shard_map(
        local, in_specs=(spec,) * 5 + (PartitionSpec(rows, None),), out_specs=spec, check_vma=False
    )(q, k, v, g, beta, segment_ids)


def _chunked_rule(q, k, v, g, beta, segment_ids, *, chunk: int, impl: str) -> jax.Array:
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge")
    n = (t + pad) // chunk

    # [B, H, N, C, ...]
    def chunks(x):
        return jnp.moveaxis(x.reshape(b, n, chunk, h, *x.shape[3:]), 3, 1)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]
    seg = segment_ids.reshape(b, 1, n, chunk)
    prev_last = jnp.concatenate([jnp.full((b, 1, 1), -1, seg.dtype), seg[:, :, :-1, -1]], axis=2)  # [B,1,N]
    last = seg[..., -1]  # [B, 1, N]

    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    same = seg[..., :, None] == seg[..., None, :]  # [B, 1, N, C, C]
    keep = causal & same
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.exp(
        jnp.where(keep, diff, -jnp.inf)
    )  # [B, H, N, C, C]: 0 across a reset or above the diagonal
    carry_in = (seg == prev_last[..., None]).astype(f32)  # reads the incoming state
    carry_out = (seg == last[..., None]).astype(f32)  # writes into the outgoing state

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    hi = _precision(impl)
    ut = jnp.einsum("...id,...jd->...ij", k_beta, k, precision=hi) * decay
    ut = jnp.where(jnp.tril(jnp.ones((chunk, chunk), bool), -1), ut, 0) + jnp.eye(chunk, dtype=f32)
    attn = jnp.einsum("...id,...jd->...ij", q, k, precision=hi) * decay
    e_cum = jnp.exp(cum) * carry_in
    ut_inv = unit_lower_inverse(ut, hi)
    new_v = jnp.einsum("...ij,...jd->...id", ut_inv, v_beta, precision=hi)
    k_cumdecay = jnp.einsum("...ij,...jd->...id", ut_inv, k_beta * e_cum[..., None], precision=hi)
    q_dec = q * e_cum[..., None]
    k_dec = k * (jnp.exp(cum[..., -1:] - cum) * carry_out)[..., None]
    chunk_decay = jnp.exp(cum[..., -1]) * (last == prev_last).astype(f32)  # [B, H, N]

    xs = tuple(
        x.reshape(b * h, n, *x.shape[3:]) for x in (new_v, k_cumdecay, q_dec, k_dec, attn, chunk_decay)
    )
    out = _recurrence(impl)(*xs).reshape(b, h, n * chunk, dv)[:, :, :t]  # [B, H, T, dv]
    return jnp.moveaxis(out, 1, 2)


def gated_rms_norm(x: jax.Array, weight: jax.Array, gate: jax.Array, eps: float) -> jax.Array:
    """transformers' Qwen3_5RMSNormGated: normalize in fp32, scale by `weight` in x's dtype, times silu(gate)."""
    x32 = x.astype(jnp.float32)
    y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = weight.astype(x.dtype) * y
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def check_heads(num_value_heads: int) -> int:
    """The devices the heads are split over (tensor x context); one line for a context split the DeltaNet
    value heads cannot take (see the module docstring)."""
    split = axis_size(current_mesh(), "linear_attn_heads")
    if context_size() > 1 and num_value_heads % split:
        raise ValueError(
            f"trainer.mesh.context={context_size()}: the model's {num_value_heads} Gated DeltaNet value heads "
            f"(linear_num_value_heads) are not divisible by tensor x context = {split}"
        )
    return split


def _to_heads(x: jax.Array) -> jax.Array:
    """[B, T, H, ...] split by token -> whole rows split by head (an all-to-all under context > 1)."""
    return constrain(x, ("batch", "attn_seq", "linear_attn_heads", *([None] * (x.ndim - 3))))


def _tokens(x: jax.Array) -> jax.Array:
    """[B, T, H, ...] pinned to the token split (heads over tensor), the layout outside the recurrence."""
    return constrain(x, ("batch", "seq", "act_heads", *([None] * (x.ndim - 3))))


def gated_deltanet(cfg, p: dict[str, jax.Array], h_btd: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """One Gated DeltaNet token mixer [B, T, D] -> [B, T, D] with one layer's weights `p` (transformer.py)."""
    dt = h_btd.dtype
    hk, hv, dk, dv = (
        cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    )  # fmt: skip
    split = check_heads(hv)
    b, t, _ = h_btd.shape
    kc = cfg.linear_conv_kernel_dim
    # The projections run where the tokens are (pinned: propagation back from the head-split constraints
    # below would otherwise all-gather h over the context axis to compute them on whole rows).
    qkv = constrain(jnp.einsum("btd,dc->btc", h_btd, p["lin_qkv"].astype(dt)), ("batch", "seq", None))
    w = p["lin_conv"].astype(dt)
    q, k = qkv[..., : hk * dk].reshape(b, t, hk, dk), qkv[..., hk * dk : 2 * hk * dk].reshape(b, t, hk, dk)
    wq, wk = w[:, : hk * dk].reshape(kc, hk, dk), w[:, hk * dk : 2 * hk * dk].reshape(kc, hk, dk)
    # Key heads the split cannot divide are repeated to the value heads first (the conv is per channel, so
    # it commutes with the repeat): an all-to-all of the repeated heads instead of an all-gather of the row.
    rep = 1 if hk % split == 0 else hv // hk
    if rep > 1:
        q, k, wq, wk = (jnp.repeat(x, rep, axis=-2) for x in (q, k, wq, wk))
    # Cut into heads while still split by token, then whole rows split by head for the conv and the rule.
    q, k = _to_heads(_tokens(q)), _to_heads(_tokens(k))
    v = _to_heads(_tokens(qkv[..., 2 * hk * dk :].reshape(b, t, hv, dv)))
    q, k = causal_conv(q, wq, segment_ids), causal_conv(k, wk, segment_ids)
    v = causal_conv(v, w[:, 2 * hk * dk :].reshape(kc, hv, dv), segment_ids)
    z = jnp.einsum("btd,dnh->btnh", h_btd, p["lin_z"].astype(dt))
    beta = jax.nn.sigmoid(_tokens(jnp.einsum("btd,dn->btn", h_btd, p["lin_b"].astype(dt))))
    a = _tokens(jnp.einsum("btd,dn->btn", h_btd, p["lin_a"].astype(dt))).astype(jnp.float32)
    g = -jnp.exp(p["lin_A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a + p["lin_dt_bias"].astype(jnp.float32)
    )
    g, beta = _to_heads(g), _to_heads(beta)
    if q.shape[2] != hv:
        q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
    q = _to_heads(_l2norm(q.astype(jnp.float32)) * dk**-0.5)
    k = _to_heads(_l2norm(k.astype(jnp.float32)))
    o = gated_delta_rule(q, k, v, g, beta, segment_ids, impl=cfg.deltanet_impl).astype(dt)
    o = to_tokens(_to_heads(o))
    o = gated_rms_norm(o, p["lin_norm"], z, cfg.rms_norm_eps)
    return jnp.einsum("btnh,nhd->btd", o, p["lin_out"].astype(dt))


def deltanet_params(cfg, *, matmul: bool) -> int:
    """One Gated DeltaNet layer's weights: the projections, and unless `matmul` the conv, decay and norm."""
    d, hk, hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = 2 * hk * dk + hv * dv
    projections = d * conv + d * hv * dv + 2 * d * hv + hv * dv * d  # qkv, z, a and b, out
    if matmul:
        return projections
    return projections + cfg.linear_conv_kernel_dim * conv + 2 * hv + dv


def deltanet_flops_per_token(cfg) -> float:
    """Training FLOPs per token of one DeltaNet layer beyond its projections (6 x multiply-adds: forward and
    backward), for the chunked form as run (models/deltanet.py, chunk C): per value head and token the
    intra-chunk [C, C] products k k^T and q k^T (2 C dk), the UT matrix's inverse (deltanet.unit_lower_inverse:
    (C^2 - 1) / 3) and its products with the keys and values (C (dk + dv)), the intra-chunk attention times
    the new values (C dv), and the state's read by keys and queries and its update (3 dk dv); plus the
    depthwise conv (K per channel). Independent of the sequence length."""
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = 2 * cfg.linear_num_key_heads * dk + hv * dv
    per_head = CHUNK * (3 * dk + 2 * dv) + (CHUNK * CHUNK - 1) // 3 + 3 * dk * dv
    return float(6 * (hv * per_head + cfg.linear_conv_kernel_dim * conv))
