"""Each GPU fast path's CPU-runnable part matches its reference, values and gradients.

The kernels themselves (cuDNN attention) only run on a GPU; tests/gpu/test_gpu_fast_paths.py checks them there
against the xla path. Here: the fused LM-head backward, the packed-segment run
description the cuDNN path feeds the kernel, the remat policies that keep attention, and the cudnn request's
CPU fallback.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from primejax.models.attention import attention, segment_runs
from primejax.models.config import ModelConfig
from primejax.models.transformer import Transformer
from primejax.trainer.fused_head import fused_token_logprobs, saved_logits_bytes
from primejax.trainer.logprobs import (
    saved_logits_max_bytes,
    token_logprobs_autodiff,
    token_logprobs_reference,
)


def _head_inputs(dtype, b=2, t=45, d=24, v=97, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (b, t, d)).astype(dtype)
    w = 0.5 * jax.random.normal(k[1], (d, v))
    y = jax.random.randint(k[2], (b, t), 0, v)
    tau = jax.random.uniform(k[3], (b, t), minval=0.6, maxval=1.4)
    coef = jax.random.normal(k[4], (b, t))
    return h, w, y, tau, coef


def _value_and_grads(fn, h, w, y, tau, coef):
    def objective(h, w):
        lp, ent = fn(h, w, y, tau)
        # Both outputs carry gradient, as in the loss (entropy only enters metrics there, but the head
        # must be right for any use).
        return jnp.sum(coef * lp) + 0.3 * jnp.sum(ent), (lp, ent)

    return jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(h, w)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("chunk", [7, 45, 1024])
def test_fused_head_matches_reference_fp32(chunk):
    h, w, y, tau, coef = _head_inputs(jnp.float32)
    (loss, (lp, ent)), (dh, dw) = _value_and_grads(
        lambda *a: fused_token_logprobs(*a, chunk_size=chunk), h, w, y, tau, coef
    )
    (loss_r, (lp_r, ent_r)), (dh_r, dw_r) = _value_and_grads(token_logprobs_reference, h, w, y, tau, coef)
    np.testing.assert_allclose(loss, loss_r, rtol=1e-5)
    np.testing.assert_allclose(lp, lp_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ent_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dh, dh_r, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, dw_r, rtol=1e-4, atol=1e-5)
    assert dw.dtype == w.dtype


def test_fused_head_matches_autodiff_chunked_in_bf16():
    """bf16 compute: the fused backward rounds d logits to bf16 once; stays within bf16 tolerance."""
    h, w, y, tau, coef = _head_inputs(jnp.bfloat16, t=64, d=32, v=300)
    (loss, _), (dh, dw) = _value_and_grads(
        lambda *a: fused_token_logprobs(*a, chunk_size=16), h, w, y, tau, coef
    )
    (loss_r, _), (dh_r, dw_r) = _value_and_grads(
        lambda *a: token_logprobs_autodiff(*a, chunk_size=16), h, w, y, tau, coef
    )
    assert _rel(loss, loss_r) < 1e-6
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    assert _rel(dh, dh_r) < 1e-2, _rel(dh, dh_r)
    assert _rel(dw, dw_r) < 1e-2, _rel(dw, dw_r)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_keeping_its_logits_matches_the_recomputing_head(dtype):
    """Saved logits are the ones the backward would recompute: the same values and gradients as the
    recomputing head over one chunk of the same shape, to float rounding (XLA fuses the two programs
    differently, so the last bit may differ)."""
    h, w, y, tau, coef = _head_inputs(dtype, t=40, d=32, v=300)
    budget = saved_logits_bytes(h.shape[0] * h.shape[1], w.shape[1], dtype)
    (loss_s, (lp_s, ent_s)), (dh_s, dw_s) = _value_and_grads(
        lambda *a: fused_token_logprobs(*a, chunk_size=16, saved_logits_max_bytes=budget), h, w, y, tau, coef
    )
    (loss_r, (lp_r, ent_r)), (dh_r, dw_r) = _value_and_grads(
        lambda *a: fused_token_logprobs(*a, chunk_size=40), h, w, y, tau, coef
    )
    np.testing.assert_allclose(lp_s, lp_r, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(ent_s, ent_r, rtol=1e-5, atol=1e-5)
    assert dh_s.dtype == dh_r.dtype and dw_s.dtype == dw_r.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: d logits rounded to bf16 either way
    assert _rel(dh_s, dh_r) < tol and _rel(dw_s, dw_r) < tol, (_rel(dh_s, dh_r), _rel(dw_s, dw_r))
    if dtype == jnp.float32:
        (_, (lp_ref, _)), (dh_ref, dw_ref) = _value_and_grads(token_logprobs_reference, h, w, y, tau, coef)
        np.testing.assert_allclose(lp_s, lp_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dh_s, dh_ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dw_s, dw_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("over_budget", [False, True])
def test_head_keeps_its_logits_only_within_the_budget(over_budget):
    """The residuals of the head's VJP hold the full [B, T, V] fp32 logits exactly when they fit."""
    h, w, y, tau, _ = _head_inputs(jnp.bfloat16, t=40, d=32, v=300)
    need = saved_logits_bytes(2 * 40, 300, jnp.bfloat16)
    assert need == 2 * 40 * 300 * (4 + 2)
    budget = need - 1 if over_budget else need
    _, vjp_fn = jax.vjp(lambda h, w: fused_token_logprobs(h, w, y, tau, 16, budget), h, w)
    shapes = {(x.shape, str(x.dtype)) for x in jax.tree.leaves(vjp_fn)}
    assert (((2, 40, 300), "float32") in shapes) is not over_budget


def test_saved_logits_budget_from_the_setting():
    assert saved_logits_max_bytes(0) == 0
    assert saved_logits_max_bytes(1.5) == 3 * 2**29
    # auto: a share of the device memory the runtime reports; the CPU reports none, so nothing is kept
    assert saved_logits_max_bytes(-1, jax.devices("cpu")[0]) == 0


def test_segment_runs_describes_each_row():
    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0], [1] * 8, [1, 2, 3, 4, 5, 6, 0, 0]], jnp.int32)
    offsets, lengths, overflow = segment_runs(seg, 4)
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1], [0, 1, 2, 3, 4]])
    np.testing.assert_array_equal(lengths, [[3, 2, 3, -1], [8, -1, -1, -1], [1, 1, 1, 1]])
    np.testing.assert_array_equal(overflow, [False, False, True])
    # every token of a row that fits is covered exactly once
    for r in range(2):
        n = int((lengths[r] > 0).sum())
        assert int(lengths[r, :n].sum()) == seg.shape[1]


def test_cudnn_request_falls_back_to_xla_off_gpu():
    k = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(k[0], (1, 32, 4, 16))
    kv = jax.random.normal(k[1], (1, 32, 2, 16))
    seg = jnp.array([[1] * 10 + [2] * 15 + [0] * 7], jnp.int32)
    out = attention(q, kv, kv, seg, impl="cudnn")
    np.testing.assert_allclose(out, attention(q, kv, kv, seg, impl="xla"), rtol=0, atol=0)


EPS32 = float(np.finfo(np.float32).eps)


def sum_of_sin_atol(h, num_layers: int) -> float:
    """How far two fp32 evaluations of sum(sin(h)) may differ when the logits h come out of `num_layers` layers
    compiled differently (scan vs unrolled, recomputed vs saved activations: XLA fuses and orders the
    arithmetic differently). Each logit carries up to one rounding of relative size eps per layer plus the
    head, which sin (slope at most 1) passes on; the final sum adds up to log2(n) roundings of partial sums
    bounded by sum|sin h|. A fixed rtol instead ties the test to one CPU's instruction set and thread count
    (a loss of 6.8 that is a sum of 768 terms of either sign measured 1.19e-6 relative on one machine)."""
    h = np.abs(np.asarray(h, np.float64))
    return EPS32 * ((num_layers + 1) * h.sum() + np.log2(h.size) * np.abs(np.sin(h)).sum())


def _tiny(remat: str, scan_layers: bool = False) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e4,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qk_norm=True,
        attention_bias=False,
        max_position_embeddings=64,
        compute_dtype="float32",
        remat_policy=remat,
        scan_layers=scan_layers,
    )


@pytest.fixture(scope="module")
def reference_grads():
    return _model_grads("none")


def _model_grads(remat: str, logits: bool = False):
    model = Transformer(_tiny(remat), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 64)
    seg = jnp.array([[1] * 10 + [2] * 14, [1] * 20 + [0] * 4], jnp.int32)
    pos = jnp.array([list(range(10)) + list(range(14)), list(range(24))], jnp.int32)
    if logits:
        return nnx.merge(graphdef, state)(tokens, pos, seg)

    def loss(state):
        h = nnx.merge(graphdef, state)(tokens, pos, seg)
        return jnp.sum(jnp.sin(h))

    return jax.jit(jax.value_and_grad(loss))(state)


@pytest.mark.parametrize("remat", ["attn", "dots_no_batch_attn", "auto"])
def test_attention_saving_remat_policies_give_the_same_gradients(remat, reference_grads):
    loss, grads = _model_grads(remat)
    loss_r, grads_r = reference_grads
    atol = sum_of_sin_atol(_model_grads("none", logits=True), _tiny(remat).num_layers)
    np.testing.assert_allclose(loss, loss_r, rtol=0, atol=atol)
    # Recomputation fuses differently, so fp32 rounding differs slightly: compare each gradient as a whole.
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r), strict=True):
        assert _rel(a, b) < 1e-5, _rel(a, b)


def test_attention_policy_saves_the_attention_output():
    """The "attn" policy keeps the attention result as a residual (so the backward need not re-run it)."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    model = Transformer(_tiny("attn", scan_layers=True), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((1, 8), jnp.int32)
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    seg = jnp.ones((1, 8), jnp.int32)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(lambda s: jnp.sum(nnx.merge(graphdef, s)(tokens, pos, seg)), state)
    # Per layer (stacked by the scan over 2 layers): the layer input [L, B, T, D] and the attention output
    # [L, B, T, H, Dh], nothing else of the layer's activations.
    # (The scan's final carry [B, T, D] is saved too: it feeds the final norm outside the scan.)
    saved = sorted(ln.split()[0] for ln in buf.getvalue().splitlines() if "output of scan" in ln)
    assert saved == ["f32[1,8,32]", "f32[2,1,8,32]", "f32[2,1,8,4,16]"], saved


def test_run_slots_follow_the_samples_per_row_bound():
    from primejax.models.attention import DEFAULT_MAX_RUNS, runs_for_segments

    # n samples + the trailing padding run; never fewer than 2 (one slot is "not packed" to jax's wrapper).
    assert [runs_for_segments(n) for n in (1, 2, 4, 64)] == [2, 3, 5, 65]
    assert runs_for_segments(None) == runs_for_segments(0) == DEFAULT_MAX_RUNS


def test_prepared_runs_are_the_kernels_description_and_only_on_the_cudnn_path():
    from primejax.models.attention import prepare_segments

    seg = jnp.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]], jnp.int32)
    # Off GPU every request resolves to the xla path, which needs no description.
    assert prepare_segments(seg, impl="cudnn", dtype=jnp.bfloat16, max_segments=2) is None
    assert prepare_segments(seg, impl="auto", dtype=jnp.bfloat16) is None
    # What the cudnn path is given: 2 samples per row -> 3 run slots, padding its own run.
    offsets, lengths, overflow = segment_runs(seg, 3)
    np.testing.assert_array_equal(offsets, [[0, 2, 5, -1], [0, -1, -1, -1]])
    np.testing.assert_array_equal(lengths, [[2, 3, 1], [6, -1, -1]])
    np.testing.assert_array_equal(overflow, [False, False])


def test_rows_over_the_segment_bound_come_out_nan_once_per_forward(monkeypatch):
    """The model checks the bound once (not per layer): an over-full row is all NaN, the others untouched."""
    from primejax.models import transformer as tr

    cfg = _tiny("none")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    seg = jnp.array([[1] * 4 + [2] * 4 + [3] * 4, [1] * 12], jnp.int32)
    pos = jnp.array([list(range(4)) * 3, list(range(12))], jnp.int32)
    ref = model(tokens, pos, seg, max_segments=4)
    seen = {}

    def prepare(segment_ids, *, impl, dtype, max_segments=None):
        seen["max_segments"] = max_segments
        return segment_runs(segment_ids, max_segments)  # as the cudnn path would, without padding slack

    monkeypatch.setattr(tr, "prepare_segments", prepare)
    out = model(tokens, pos, seg, max_segments=2)  # row 0 packs 3 samples: over the bound
    assert seen["max_segments"] == 2
    assert bool(jnp.all(jnp.isnan(out[0])))
    np.testing.assert_array_equal(out[1], ref[1])


def test_auto_remat_policy_picks_by_micro_batch_tokens():
    from primejax.models.remat import AUTO_REMAT_MAX_TOKENS_FOR_DOTS, resolve_remat_policy

    assert resolve_remat_policy("auto", 16384) == "dots_no_batch_attn"
    assert resolve_remat_policy("auto", AUTO_REMAT_MAX_TOKENS_FOR_DOTS) == "dots_no_batch_attn"
    assert resolve_remat_policy("auto", 65536) == "attn"
    assert resolve_remat_policy("none", 65536) == "none"


@pytest.mark.parametrize("remat", ["none", pytest.param("dots_no_batch_attn", marks=pytest.mark.slow)])
def test_unrolled_layers_match_the_scan(remat):
    """scan_layers only changes how the layers are compiled: same loss and gradients (fp32)."""
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    pos = jnp.tile(jnp.arange(12, dtype=jnp.int32), (2, 1))
    seg = jnp.array([[1] * 5 + [2] * 7, [1] * 10 + [0] * 2], jnp.int32)
    results = []
    for scan in (True, False):
        graphdef, state = nnx.split(Transformer(_tiny(remat, scan_layers=scan), rngs=nnx.Rngs(0)))
        if not scan:
            atol = sum_of_sin_atol(nnx.merge(graphdef, state)(tokens, pos, seg), _tiny(remat).num_layers)

        def loss(s, graphdef=graphdef):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, s)(tokens, pos, seg)))

        results.append(jax.jit(jax.value_and_grad(loss))(state))
    (l_scan, g_scan), (l_unrolled, g_unrolled) = results
    np.testing.assert_allclose(l_unrolled, l_scan, rtol=0, atol=atol)
    for a, b in zip(jax.tree.leaves(g_unrolled), jax.tree.leaves(g_scan), strict=True):
        assert _rel(a, b) < 1e-5, _rel(a, b)


def test_single_sample_rows_flag_what_plain_causal_attention_would_get_wrong():
    from primejax.models.attention import prepare_segments, single_sample_rows

    seg = jnp.array([[1, 1, 1, 0], [1, 1, 2, 0], [0, 0, 1, 1], [0, 0, 0, 0], [3, 3, 3, 3]], jnp.int32)
    # One sample then padding, or an empty row: exact under plain causal attention. Two samples, or
    # padding before the sample: flagged (the model turns such rows into NaN).
    runs = single_sample_rows(seg)
    assert runs.offsets is None and runs.lengths is None
    np.testing.assert_array_equal(runs.overflow, [False, True, True, False, False])
    # Off GPU the request resolves to the xla path, which needs no description.
    assert prepare_segments(seg, impl="cudnn", dtype=jnp.bfloat16, max_segments=1) is None
