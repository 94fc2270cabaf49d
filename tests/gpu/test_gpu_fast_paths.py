"""Every GPU fast path of the trainer against its XLA reference on the GPU, values and gradients at bf16
tolerance: cuDNN attention on packed rows (several segments, padding, GQA 16/8, head dim 128) and on one sample
per row, the packed-run bound's overflow flag, and the chunked / fused / saved-logits LM heads against fp32 logits.
tests/perf/test_fast_paths.py checks the CPU-runnable parts of the same paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from primejax.models.attention import attention, prepare_segments
from primejax.trainer.fused_head import fused_token_logprobs
from primejax.trainer.logprobs import token_logprobs, token_logprobs_reference


def rel(a, b) -> float:
    """Relative error ||a - b|| / ||b|| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _fast_path_errors() -> dict:
    """Each fast path's relative error against XLA (`errors`) and whether the packed-run bounds flag rows with
    more segments than they hold (`overflow_flagged`, `causal_overflow_flagged`: row 0 has 4, row 1 one)."""
    out: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    # Attention on packed rows: several segments of uneven length plus trailing padding, GQA 16/8, Dh 128.
    t = 4096
    seg = np.zeros((2, t), np.int32)
    for r, lens in enumerate([(300, 1700, 1000, 1000), (4000,)]):
        pos = 0
        for s, n in enumerate(lens, 1):
            seg[r, pos : pos + n] = s
            pos += n
    seg = jnp.asarray(seg)
    k = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(k[0], (2, t, 16, 128), jnp.bfloat16)
    kk = jax.random.normal(k[1], (2, t, 8, 128), jnp.bfloat16)
    v = jax.random.normal(k[2], (2, t, 8, 128), jnp.bfloat16)
    cot = jax.random.normal(k[3], q.shape, jnp.bfloat16)

    def fwd_bwd(impl):
        def f(q, kk, v):
            return jnp.sum((attention(q, kk, v, seg, impl=impl) * cot).astype(jnp.float32))

        o = jax.jit(lambda q, kk, v: attention(q, kk, v, seg, impl=impl))(q, kk, v)
        return o, jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, kk, v)

    o_ref, g_ref = fwd_bwd("xla")
    o_fast, g_fast = fwd_bwd("cudnn")
    errs = {"attn_out": rel(o_fast, o_ref)}
    errs.update({f"attn_d{n}": rel(a, b) for n, a, b in zip("qkv", g_fast, g_ref, strict=True)})
    # As the model runs it: the runs described once, with the step's bound (4 samples -> 5 run slots).
    runs = prepare_segments(seg, impl="cudnn", dtype=q.dtype, max_segments=4)
    o_runs = jax.jit(lambda q, kk, v: attention(q, kk, v, seg, impl="cudnn", runs=runs))(q, kk, v)
    errs["attn_out_bound4"] = rel(o_runs, o_ref)
    tight = prepare_segments(seg, impl="cudnn", dtype=q.dtype, max_segments=2)  # row 0 has 4: must flag
    out["overflow_flagged"] = [bool(x) for x in np.asarray(tight.overflow)]
    # One sample per row, padding last: the plain causal kernel, compared on the sample's tokens (values
    # and gradients; the padding gets no cotangent, as in the trainer where it carries no loss).
    seg1 = jnp.asarray(np.repeat([[1] * 3000 + [0] * (t - 3000)], 2, axis=0), jnp.int32)
    one = prepare_segments(seg1, impl="cudnn", dtype=q.dtype, max_segments=1)
    real = (seg1 > 0)[:, :, None, None]
    cot1 = jnp.where(real, cot, 0)

    def one_sample(impl, runs):
        def f(q, kk, v):
            return jnp.sum((attention(q, kk, v, seg1, impl=impl, runs=runs) * cot1).astype(jnp.float32))

        o = jax.jit(lambda q, kk, v: attention(q, kk, v, seg1, impl=impl, runs=runs))(q, kk, v)
        return jnp.where(real, o, 0), jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, kk, v)

    (o1_ref, g1_ref), (o1, g1) = one_sample("xla", None), one_sample("cudnn", one)
    errs["causal_out"] = rel(o1, o1_ref)
    errs.update({f"causal_d{n}": rel(a, b) for n, a, b in zip("qkv", g1, g1_ref, strict=True)})
    out["causal_overflow_flagged"] = [
        bool(x)
        for x in np.asarray(prepare_segments(seg, impl="cudnn", dtype=q.dtype, max_segments=1).overflow)
    ]
    # LM head + logprobs against full fp32 logits.
    b, t, d, vocab = 1, 4096, 1024, 151936
    k = jax.random.split(jax.random.key(1), 5)
    h = jax.random.normal(k[0], (b, t, d), jnp.bfloat16)
    w = 0.02 * jax.random.normal(k[1], (d, vocab), jnp.float32)
    y = jax.random.randint(k[2], (b, t), 0, vocab)
    tau = jax.random.uniform(k[3], (b, t), minval=0.7, maxval=1.3)
    coef = jax.random.normal(k[4], (b, t))

    def head(fn):
        def f(h, w):
            lp, ent = fn(h, w)
            return jnp.sum(coef * lp) + 0.1 * jnp.sum(ent), (lp, ent)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)

    (l_r, (lp_r, ent_r)), (gh_r, gw_r) = head(lambda h, w: token_logprobs_reference(h, w, y, tau))
    heads = {
        "head": lambda h, w: token_logprobs(h, w, y, tau, 1024),  # chunked, recomputed per chunk
        "fused_head": lambda h, w: fused_token_logprobs(h, w, y, tau, 1024),
        # the same head keeping its fp32 logits for the backward instead of recomputing them
        "saved_head": lambda h, w: fused_token_logprobs(h, w, y, tau, 1024, 1 << 40),
    }
    for name, fn in heads.items():
        (l_f, (lp_f, ent_f)), (gh_f, gw_f) = head(fn)
        pairs = dict(
            loss=(l_f, l_r), logprobs=(lp_f, lp_r), entropy=(ent_f, ent_r), dh=(gh_f, gh_r), dw=(gw_f, gw_r)
        )
        errs.update({f"{name}_{k}": rel(a, b) for k, (a, b) in pairs.items()})
    out["errors"] = errs
    return out


def test_gpu_fast_paths_match_their_xla_references():
    out = _fast_path_errors()
    print(f"\n{out}")
    assert out["overflow_flagged"] == [True, False] and out["causal_overflow_flagged"] == [True, False], out
    bad = {k: e for k, e in out["errors"].items() if not (np.isfinite(e) and e < 2e-2)}
    assert not bad, out
