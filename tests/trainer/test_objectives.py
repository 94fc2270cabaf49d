"""A new rl objective is one registered function: it trains a step of the tiny model on CPU with the loss its
formula gives, and the registry refuses what would make a config value ambiguous."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from primejax.contracts.batch import TrainingSample, pack_samples
from primejax.models.sharding import make_mesh
from primejax.models.transformer import init_model
from primejax.trainer import optim
from primejax.trainer.engine import jit_train_step
from primejax.trainer.losses import LossConfig, make_loss_fn
from primejax.trainer.objectives import LossInputs, LossOutputs, register_loss, registered_losses
from primejax.trainer.step import device_batch, init_state, make_train_step, target_logprobs, to_micro_batches


@register_loss("reinforce_for_test")
def reinforce(inputs: LossInputs, scale: float = 1.0) -> LossOutputs:
    """REINFORCE without a trust region: -scale * sum_t A_t * lp_t over the sequence's rl tokens."""
    mask = inputs.loss_mask
    loss = -scale * jnp.sum(jnp.where(mask, inputs.advantages * inputs.trainer_logprobs, 0.0))
    mean_adv = jnp.sum(jnp.where(mask, inputs.advantages, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
    return LossOutputs(loss=loss, metrics={"mean_adv": mean_adv})


def test_a_registered_objective_trains_a_step_with_its_own_formula(make_config):
    tiny_cfg = make_config(num_layers=1)  # one layer is enough: the objective is what is under test
    graphdef = nnx.graphdef(init_model(tiny_cfg, None, seed=1))
    sched = optim.make_schedule(3e-3)
    opt = optim.make_optimizer(
        {"lr": 3e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "max_norm": 1.0}, sched
    )
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = init_state(init_model(tiny_cfg, None, seed=1), opt, mesh=mesh)
    cfg = LossConfig(type="reinforce_for_test", kwargs={"scale": 2.0})
    step = jit_train_step(make_train_step(graphdef, opt, sched, cfg, max_segments=2), state, mesh)
    logprobs = jax.jit(lambda params, arrays: target_logprobs(nnx.merge(graphdef, params), arrays))

    prompt, good, bad = [5, 9, 13, 2], [7, 7, 3, 1], [8, 4, 11, 6]
    samples = [
        TrainingSample(prompt + c, [False] * 4 + [True] * 4, [0.0] * 8, advantages=[a] * 8)
        for c, a in ((good, 1.0), (bad, -0.5))
    ]
    (batch,) = pack_samples(samples, seq_len=16)
    lp0 = np.asarray(logprobs(state.params, batch.arrays()), np.float64)
    batch.inference_logprobs = np.where(batch.loss_mask, lp0, 0.0).astype(np.float32)

    with jax.set_mesh(mesh):
        state, metrics = step(state, device_batch(to_micro_batches(batch, 1), mesh))

    mask = batch.loss_mask
    expected = -2.0 * np.sum(batch.advantages[mask] * lp0[mask]) / mask.sum()  # the sum over sequences / N_rl
    np.testing.assert_allclose(float(metrics["loss/rl"]), expected, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["custom/mean_adv"]), (1.0 - 0.5) / 2, rtol=1e-6)
    assert int(metrics["nonfinite"]) == 0 and int(state.step) == 1
    lp1 = np.asarray(logprobs(state.params, batch.arrays()), np.float64)
    seg = batch.segment_ids
    assert lp1[mask & (seg == 1)].sum() > lp0[mask & (seg == 1)].sum()  # the positive advantage rose
    assert lp1[mask & (seg == 2)].sum() < lp0[mask & (seg == 2)].sum()  # the negative one fell


def test_the_registry_refuses_ambiguous_names_and_names_what_it_holds():
    assert {"ppo_clip", "reinforce_for_test"} <= set(registered_losses())
    assert register_loss("reinforce_for_test")(reinforce) is reinforce  # the same function again: a no-op
    with pytest.raises(ValueError, match="already registered as 'reinforce_for_test'"):
        register_loss("reinforce_for_test")(lambda inputs: None)
    for builtin in ("default", "custom"):
        with pytest.raises(ValueError, match="built in"):
            register_loss(builtin)(reinforce)
    with pytest.raises(
        ValueError, match=r"'nope' is not a registered rl objective \(registered: .*'ppo_clip'"
    ):
        make_loss_fn(LossConfig(type="nope"))
