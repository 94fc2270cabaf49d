"""The trainer engine: its RL and SFT steps give the loss of the documented formula on a fixed batch.

The reference is computed independently of the step code: full-vocabulary logits in float64 numpy from the
model's hidden states, then each component's per-token loss (docs/algorithms.md; rl = DPPO + KL, ce, ref_kl),
summed over the whole step and divided by its member-token count. The engine splits the batch into several
micro-batches, so the global normalization and the accumulation are covered too; the two step kinds use
different loss settings (the SFT step must not take the rl loss's), which the reference follows.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import random_samples, tiny_config
from flax import nnx

from primejax.contracts.batch import pack_samples
from primejax.models.transformer import init_model
from primejax.trainer.config import LossConfig, TrainerConfig
from primejax.trainer.engine import STEP_KINDS, Engine


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def reference_loss(engine: Engine, arrays: dict[str, np.ndarray], cfg: LossConfig) -> float:
    """Σ_c (Σ_t w·loss_c) / N_c over the whole batch, from full float64 logits (the step's formula)."""
    model = engine.model()
    hidden = np.asarray(model(arrays["tokens"], arrays["positions"], arrays["segment_ids"]), np.float64)
    w_head = np.asarray(model.lm_head_weight(), np.float64)
    a = {k: np.asarray(v) for k, v in arrays.items()}
    # token t is predicted by hidden state t - 1, at token t's sampling temperature
    logits = np.einsum("btd,dv->btv", hidden[:, :-1], w_head) / a["temperatures"][:, 1:, None]
    lp = np.zeros(a["tokens"].shape)
    lp[:, 1:] = np.take_along_axis(_log_softmax(logits), a["tokens"][:, 1:, None], -1)[..., 0]
    lq, adv, lref = a["inference_logprobs"], a["advantages"], a["ref_logprobs"]
    trained = a["loss_mask"].copy()
    trained[:, 0] = False
    log_r = np.where(trained, lp - lq, 0.0)
    r, d = np.exp(log_r), np.exp(lp) - np.exp(lq)
    kl = cfg.kl_tau * log_r**2
    masked = np.where(adv > 0, d > cfg.dppo_mask_high, d < -cfg.dppo_mask_low)
    per_token = {
        "rl": -np.where(masked, 0.0, cfg.adv_tau * adv * np.minimum(r, cfg.is_clip)) + kl,
        "ce": -lp,
        "ref_kl": -np.where(d < -cfg.dppo_mask_low, 0.0, (lref - lp) * r) + kl,
    }
    total = 0.0
    for c, loss in per_token.items():
        w = a[f"{c}_weights"]
        member = trained & (w != 0)
        total += float(np.sum(np.where(member, w * loss, 0.0))) / max(int(member.sum()), 1)
    return total


RL_LOSS = LossConfig(kl_tau=0.05, dppo_mask_low=0.05, dppo_mask_high=0.1, adv_tau=0.7)


def test_rl_and_sft_steps_on_one_engine_give_the_formula_loss():
    """Both step kinds on one engine and one state, each with its own loss settings (SFT never takes the rl
    loss's), each step's loss equal to the reference computed from the state it starts from."""
    t = TrainerConfig(micro_batch_size=2, logprob_chunk_size=16, loss=RL_LOSS)
    engine = Engine.create(t, tiny_config(), seed=3)
    (batch,) = pack_samples(random_samples(7, 14), 48)
    assert batch.rows > 2 * engine.micro_rows  # several micro-batches, the last one padded
    arrays = batch.arrays()
    for kind in ("rl", "sft", "rl", "sft"):
        expected = reference_loss(engine, arrays, RL_LOSS if kind == "rl" else LossConfig())
        metrics, tokens = engine.train(batch, kind)
        assert int(metrics["nonfinite"]) == 0
        np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=2e-5, err_msg=kind)
    assert tokens == -(-batch.rows // engine.micro_rows) * engine.micro_rows * batch.seq_len
    assert int(engine.state.step) == 4
    assert sorted(k for k, _ in engine._compiled) == list(STEP_KINDS)  # each kind compiled once
    assert engine.params_finite()


def test_abstract_engine_allocates_nothing_and_lowers_the_same_step():
    """The abstract engine (AOT) holds ShapeDtypeStructs shaped and sharded like the concrete state."""
    t = TrainerConfig(loss=LossConfig(type="custom", import_path="no.such.module"))
    abstract = Engine.create(t, tiny_config(), seed=0, abstract=True)
    params = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(init_model(tiny_config(), None, 0))))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract.state))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), abstract.state.params) == jax.tree.map(
        lambda x: (x.shape, x.dtype), params
    )
    lowered = abstract.lower(abstract.abstract_batch(2, 1, 32), "sft")
    assert "while" in lowered.as_text()  # two micro-batches: the scan over them
    # the SFT step takes the default loss section, whatever the rl loss is (here one that cannot load)
    assert abstract.loss_config("sft") == LossConfig()
    assert abstract.loss_config("rl").type == "custom"
    with pytest.raises(ValueError, match="step kind"):
        abstract.loss_config("dpo")
