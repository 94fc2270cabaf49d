"""GPU correctness checks of tools/bench_trainer.py: every fast path (cuDNN attention, packed and plain causal;
the LM head, recomputing and keeping its logits) against its XLA reference.
Run in the bench's `check` worker process, on the device."""

from __future__ import annotations


def _rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_worker(c: dict) -> dict:
    """Every GPU fast path against its XLA reference: forward values and gradients, bf16 tolerance."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from primejax.models.attention import attention, prepare_segments
    from primejax.trainer.fused_head import fused_token_logprobs
    from primejax.trainer.logprobs import token_logprobs, token_logprobs_reference

    out: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    try:
        from jax._src import cuda_versions

        out["cudnn"] = cuda_versions.cudnn_get_version()
    except Exception as e:  # noqa: BLE001 - informational only
        out["cudnn"] = repr(e)
    tol = 2e-2
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
    errs = {"attn_out": _rel(o_fast, o_ref)}
    errs.update({f"attn_d{n}": _rel(a, b) for n, a, b in zip("qkv", g_fast, g_ref, strict=True)})
    # As the model runs it: the runs described once, with the step's bound (4 samples -> 5 run slots).
    runs = prepare_segments(seg, impl="cudnn", dtype=q.dtype, max_segments=4)
    o_runs = jax.jit(lambda q, kk, v: attention(q, kk, v, seg, impl="cudnn", runs=runs))(q, kk, v)
    errs["attn_out_bound4"] = _rel(o_runs, o_ref)
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
    errs["causal_out"] = _rel(o1, o1_ref)
    errs.update({f"causal_d{n}": _rel(a, b) for n, a, b in zip("qkv", g1, g1_ref, strict=True)})
    out["causal_overflow_flagged"] = [
        bool(x)
        for x in np.asarray(prepare_segments(seg, impl="cudnn", dtype=q.dtype, max_segments=1).overflow)
    ]
    # LM head + logprobs: chunked (recomputed per chunk) vs full fp32 logits.
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

    (l_f, (lp_f, ent_f)), (gh_f, gw_f) = head(lambda h, w: token_logprobs(h, w, y, tau, 1024))
    (l_r, (lp_r, ent_r)), (gh_r, gw_r) = head(lambda h, w: token_logprobs_reference(h, w, y, tau))
    errs.update(
        head_loss=_rel(l_f, l_r),
        head_logprobs=_rel(lp_f, lp_r),
        head_entropy=_rel(ent_f, ent_r),
        head_dh=_rel(gh_f, gh_r),
        head_dw=_rel(gw_f, gw_r),
    )
    (l_f, (lp_f, ent_f)), (gh_f, gw_f) = head(lambda h, w: fused_token_logprobs(h, w, y, tau, 1024))
    errs.update(
        fused_head_loss=_rel(l_f, l_r),
        fused_head_logprobs=_rel(lp_f, lp_r),
        fused_head_entropy=_rel(ent_f, ent_r),
        fused_head_dh=_rel(gh_f, gh_r),
        fused_head_dw=_rel(gw_f, gw_r),
    )
    # The same head keeping its fp32 logits for the backward instead of recomputing them.
    (l_f, (lp_f, ent_f)), (gh_f, gw_f) = head(lambda h, w: fused_token_logprobs(h, w, y, tau, 1024, 1 << 40))
    errs.update(
        saved_head_loss=_rel(l_f, l_r),
        saved_head_logprobs=_rel(lp_f, lp_r),
        saved_head_entropy=_rel(ent_f, ent_r),
        saved_head_dh=_rel(gh_f, gh_r),
        saved_head_dw=_rel(gw_f, gw_r),
    )
    out["errors"] = errs
    out["ok"] = (
        all(np.isfinite(e) and e < tol for e in errs.values())
        and out["overflow_flagged"] == [True, False]
        and out["causal_overflow_flagged"] == [True, False]
    )
    return out
