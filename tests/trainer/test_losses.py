"""The loss components against a NumPy re-implementation of docs/architecture.md#losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primejax.trainer.losses import COMPONENTS, LossConfig, finalize_metrics, global_counts, make_loss_fn

CFG = LossConfig(dppo_mask_low=0.2, dppo_mask_high=0.2, adv_tau=1.0, kl_tau=1e-3, is_clip=8.0)


def np_loss(lp, b, cfg: LossConfig):
    """Straight transcription of the formulas (float64), component by component."""
    lq, adv, lref = b["inference_logprobs"], b["advantages"], b["ref_logprobs"]
    log_r = lp - lq
    r = np.exp(log_r)
    d = np.exp(lp) - np.exp(lq)
    out, counts = {}, {}
    for c in COMPONENTS:
        w = b[f"{c}_weights"]
        member = b["loss_mask"] & (w != 0)
        counts[c] = member.sum()
        if c == "rl":
            masked = ((adv > 0) & (d > cfg.dppo_mask_high)) | ((adv <= 0) & (d < -cfg.dppo_mask_low))
            keep = member & ~masked
            tok = (
                -1.0 * keep * cfg.adv_tau * adv * np.minimum(r, cfg.is_clip) + cfg.kl_tau * member * log_r**2
            )
        elif c == "ce":
            tok = -1.0 * member * lp
        else:
            keep = member & ~(d < -cfg.dppo_mask_low)
            tok = -1.0 * keep * (lref - lp) * r + cfg.kl_tau * member * log_r**2
        out[c] = np.sum(np.where(member, w * tok, 0.0)) / max(counts[c], 1)
    return sum(out.values()), out, counts


def branch_batch():
    """One row hitting every rl branch: A>0 kept/masked, A<=0 kept/masked, the delta clamp, weight 0."""
    lq = np.log(np.array([0.5, 0.5, 0.5, 0.5, 0.5, np.exp(-10), np.exp(-10), 0.5, 0.5, 0.3]))
    lp = np.log(np.array([0.6, 0.9, 0.4, 0.1, 0.5, np.exp(-2.5), np.exp(-2.5), 0.2, 0.7, 0.3]))
    adv = np.array([1.0, 1.0, -1.0, -1.0, 0.0, 2.0, -2.0, 1.0, -1.0, 1.0])
    #              keep  high  keep  low   keep  clamp clamp keep  keep  weight 0
    n = len(lq)
    b = {
        "loss_mask": np.ones(n, bool),
        "inference_logprobs": lq,
        "advantages": adv,
        "ref_logprobs": np.log(np.full(n, 0.4)),
        "rl_weights": np.array([1.0] * 9 + [0.0]),
        "ce_weights": np.array([0.0] * 5 + [0.5] * 5),
        "ref_kl_weights": np.array([1.0, 0, 1.0, 0, 1.0, 0, 0, 1.0, 1.0, 0]),
        "segment_ids": np.ones(n, np.int32),
    }
    b["loss_mask"][4] = False  # loss_mask False removes the token from every component
    return lp[None], {k: v[None] for k, v in b.items()}


def _jax_loss(lp, b, cfg=CFG, max_segments=0):
    jb = {k: jnp.asarray(v) for k, v in b.items()}
    counts = global_counts(jb)
    loss, sums = make_loss_fn(cfg, max_segments)(jnp.asarray(lp), jnp.zeros_like(jnp.asarray(lp)), jb, counts)
    return loss, sums, counts


def test_every_branch_matches_numpy():
    lp, b = branch_batch()
    loss, sums, counts = _jax_loss(lp, b)
    ref_total, ref, ref_counts = np_loss(lp, b, CFG)
    np.testing.assert_allclose(loss, ref_total, rtol=1e-5)
    for c in COMPONENTS:
        np.testing.assert_allclose(sums[f"loss/{c}"], ref[c], rtol=1e-5, atol=1e-7)
        assert counts[c] == ref_counts[c]
    assert counts["rl"] == 8  # 10 tokens - weight 0 - loss_mask False
    assert sums["masked_high"] == 1 and sums["masked_low"] == 1


def test_branch_gradients():
    """Masked tokens and clamped ratios give no policy-gradient signal, only the KL term's gradient."""
    lp, b = branch_batch()
    b = {
        **b,
        "ce_weights": np.zeros_like(b["ce_weights"]),
        "ref_kl_weights": np.zeros_like(b["ref_kl_weights"]),
    }
    cfg = LossConfig(kl_tau=0.0)
    g = np.asarray(jax.grad(lambda x: _jax_loss(x, b, cfg)[0])(jnp.asarray(lp)))[0]
    n = 8
    r = np.exp(lp[0] - b["inference_logprobs"][0])
    expected = -b["advantages"][0] * r / n
    for t in (1, 3, 4, 5, 6, 9):  # masked high, masked low, not in loss_mask, clamped x2, weight 0
        expected[t] = 0.0
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-8)


def test_random_inputs_match_numpy():
    rng = np.random.default_rng(0)
    shape = (3, 40)
    lq = np.log(rng.uniform(0.01, 1.0, shape))
    lp = lq + rng.normal(scale=0.8, size=shape)
    lp = np.minimum(lp, -1e-3)
    b = {
        "loss_mask": rng.random(shape) < 0.8,
        "inference_logprobs": lq,
        "advantages": rng.normal(size=shape),
        "ref_logprobs": np.log(rng.uniform(0.01, 1.0, shape)),
        "rl_weights": rng.choice([0.0, 0.5, 1.0], shape),
        "ce_weights": rng.choice([0.0, 1.0, 2.0], shape),
        "ref_kl_weights": rng.choice([0.0, 1.0], shape),
        "segment_ids": np.ones(shape, np.int32),
    }
    cfg = LossConfig(dppo_mask_low=0.1, dppo_mask_high=0.3, adv_tau=0.7, kl_tau=0.05, is_clip=2.0)
    loss, sums, _ = _jax_loss(lp, b, cfg)
    ref_total, ref, _ = np_loss(lp, b, cfg)
    np.testing.assert_allclose(loss, ref_total, rtol=1e-5)
    for c in COMPONENTS:
        np.testing.assert_allclose(sums[f"loss/{c}"], ref[c], rtol=1e-5, atol=1e-7)


def test_empty_components_contribute_zero_without_nan():
    lp, b = branch_batch()
    b = {**b, "loss_mask": np.zeros_like(b["loss_mask"])}
    loss, sums, counts = _jax_loss(lp, b)
    metrics = finalize_metrics(sums, counts)
    assert float(loss) == 0.0 and all(float(counts[c]) == 0 for c in COMPONENTS)
    assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())
    g = jax.grad(lambda x: _jax_loss(x, b)[0])(jnp.asarray(lp))
    assert np.all(np.asarray(g) == 0)


def test_metrics_mismatch_kl_and_fractions():
    lp, b = branch_batch()
    loss, sums, counts = _jax_loss(lp, b)
    m = finalize_metrics(sums, counts)
    sampled = b["loss_mask"][0] & ((b["rl_weights"][0] != 0) | (b["ref_kl_weights"][0] != 0))
    log_r = (lp - b["inference_logprobs"])[0][sampled]
    np.testing.assert_allclose(m["mismatch_kl"], np.mean(np.exp(log_r) - log_r - 1), rtol=1e-5)
    np.testing.assert_allclose(m["masked_high_frac"], 1 / 8)
    np.testing.assert_allclose(m["masked_low_frac"], 1 / 8)
    assert m["tokens/rl"] == 8 and m["tokens/ce"] == 5 and m["tokens/ref_kl"] == 4


@pytest.mark.parametrize("clip_eps", [0.2, 0.05])
def test_custom_loss_per_sequence(clip_eps):
    """The custom loss sees each packed sequence alone; the rl component is sum over sequences / N_rl."""
    rng = np.random.default_rng(1)
    shape = (2, 12)
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12])
    lq = np.log(rng.uniform(0.1, 0.9, shape))
    lp = lq + rng.normal(scale=0.3, size=shape)
    b = {
        "loss_mask": (seg > 0) & (rng.random(shape) < 0.9),
        "inference_logprobs": lq,
        "advantages": rng.normal(size=shape),
        "ref_logprobs": np.zeros(shape),
        "rl_weights": rng.choice([0.0, 1.0, 2.0], shape),
        "ce_weights": np.zeros(shape),
        "ref_kl_weights": np.zeros(shape),
        "segment_ids": seg.astype(np.int32),
    }
    cfg = LossConfig(
        type="custom", import_path="primejax.trainer.objectives.ppo_clip_loss", kwargs={"clip_eps": clip_eps}
    )
    loss, sums, counts = _jax_loss(lp, b, cfg, max_segments=4)
    member = b["loss_mask"] & (b["rl_weights"] != 0)
    ratio = np.exp(lp - lq)
    clipped = np.clip(ratio, 1 - clip_eps, 1 + clip_eps)
    surr = np.minimum(ratio * b["advantages"], clipped * b["advantages"])
    expected = -np.sum(np.where(member, b["rl_weights"] * surr, 0)) / member.sum()
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    fracs = [
        ((ratio != clipped) & member & (seg == s))[r].sum() / (member & (seg == s))[r].sum()
        for r in range(2)
        for s in (1, 2)
        if (member & (seg == s))[r].any()
    ]
    m = finalize_metrics(sums, counts)
    np.testing.assert_allclose(m["custom/clip_frac"], np.mean(fracs), rtol=1e-5)
    assert sums["custom/num_sequences"] == len(fracs) == 3


def test_bad_custom_import_path_is_a_clear_error():
    with pytest.raises(ValueError, match="does not resolve"):
        make_loss_fn(LossConfig(type="custom", import_path="primejax.trainer.objectives.nope"))


def test_mismatch_kl_is_accurate_for_a_nearly_synced_policy():
    """fp32 exp(x) - x - 1 cancels to 0 or below for |x| ~ 1e-4; the metric must still read ~x^2 / 2."""
    lp, b = branch_batch()
    lp = (b["inference_logprobs"] + 1e-4).astype(np.float32)
    _, sums, counts = _jax_loss(lp, b)
    m = finalize_metrics(sums, counts)
    np.testing.assert_allclose(m["mismatch_kl"], 0.5e-8, rtol=0.05)
