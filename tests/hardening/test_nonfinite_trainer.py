"""The trainer never produces, exports or checkpoints non-finite parameters (the update is checked, not only
the loss and gradient), and a skipped step shows in the metrics."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from primejax.contracts.batch import pack_samples
from primejax.models.sharding import make_mesh
from primejax.models.transformer import init_model
from primejax.trainer import optim
from primejax.trainer.engine import jit_train_step
from primejax.trainer.losses import LossConfig
from primejax.trainer.step import device_batch, init_state, make_train_step, to_micro_batches

# The trainer tests' tiny model and random samples (their conftest, loaded by path: module names clash).
_spec = importlib.util.spec_from_file_location(
    "trainer_helpers", Path(__file__).parents[1] / "trainer" / "conftest.py"
)
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
random_samples, tiny_config = _helpers.random_samples, _helpers.tiny_config


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): a whole step compile; the default tier: the guard with lr=nan below
def test_a_nan_learning_rate_never_reaches_the_parameters():
    cfg = tiny_config(num_layers=1)
    nan = float("nan")
    sched = optim.make_schedule(nan)  # the config rejects lr=nan now; the step guard must hold regardless
    opt = optim.make_optimizer(
        {"lr": nan, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "max_norm": 1.0}, sched
    )
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = init_state(init_model(cfg, None, seed=0), opt, mesh=mesh)
    before = jax.tree.map(np.asarray, state.params)
    step = jit_train_step(
        make_train_step(nnx.graphdef(init_model(cfg, None, seed=0)), opt, sched, LossConfig()), state, mesh
    )
    (batch,) = pack_samples(random_samples(0, 2, max_len=20, streams=False), seq_len=48)
    with jax.set_mesh(mesh):
        state, metrics = step(state, device_batch(to_micro_batches(batch, 1), mesh))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert int(metrics["nonfinite"]) == 1 and int(state.step) == 0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def _guard_case(lr: float, grad_scale: float, finite: bool):
    from primejax.trainer.step import guarded_update

    rng = np.random.default_rng(0)
    params = {
        "w": jax.numpy.asarray(rng.standard_normal((8, 16)), "float32"),
        "b": jax.numpy.asarray(rng.standard_normal((16,)), "float32"),
    }
    grads = jax.tree.map(lambda p: grad_scale * jax.numpy.ones_like(p) + 0.1 * p, params)
    opt = optim.make_optimizer(
        {"lr": lr, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "max_norm": 0.0},
        optim.make_schedule(lr),
    )
    state = opt.init(params)
    state = opt.update(grads, state, params)[1]  # non-trivial moments and count
    out = {
        g: jax.jit(lambda gr, s, p, g=g: guarded_update(opt, gr, s, p, jax.numpy.asarray(finite), g))(
            grads, state, params
        )
        for g in ("fused", "select")
    }
    return params, state, grads, opt, out


def test_fused_guard_equals_select_and_plain_update_on_a_finite_step():
    params, state, grads, opt, out = _guard_case(1e-3, 1.0, True)

    def plain_update(g, s, p):
        updates, s2 = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s2

    plain = jax.jit(plain_update)(grads, state, params)
    for guard, (p, s, ok) in out.items():
        assert bool(ok), guard
        for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves(plain), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=guard)


@pytest.mark.parametrize(
    "lr, grad_scale, finite",
    [
        (float("nan"), 1.0, True),  # a NaN learning rate: loss and gradient finite, the update not
        (1e-3, 1e20, True),  # a finite gradient whose square overflows the second moment
        (1e-3, 1.0, False),
    ],  # a non-finite loss or gradient norm reported by the caller
)
def test_guard_keeps_parameters_and_moments_on_a_non_finite_update(lr, grad_scale, finite):
    params, state, _, _, out = _guard_case(lr, grad_scale, finite)
    for guard, (p, s, ok) in out.items():
        assert not bool(ok), guard
        for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((params, state)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=guard)
