"""The trainer step on a tiny Qwen3-MoE: MaxViolation and expert load come out, the auxiliary losses are off
by default and add exactly their configured share when on, and the logged metrics flatten per layer."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from primejax.contracts.batch import pack_samples
from primejax.models import moe
from primejax.models.transformer import init_model
from primejax.trainer.losses import LossConfig
from primejax.trainer.moe_metrics import flatten_moe_metrics
from primejax.trainer.step import make_grad_fn, to_micro_batches


def test_moe_step_metrics_and_aux_losses(make_samples, make_config):
    cfg = make_config(
        model_type="qwen3_moe",
        num_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=(0,),
    )
    model = init_model(cfg, None, seed=0)
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    (batch,) = pack_samples(make_samples(0, 6, max_len=20), seq_len=40, pad_rows_to_multiple=2)
    arrays = to_micro_batches(batch, 1)  # 2 micro-batches: metrics are micro-batch means
    results = {}
    for name, lc in {
        "off": LossConfig(),
        "aux": LossConfig(moe_aux_coef=0.1),
        "z": LossConfig(moe_z_coef=0.01),
    }.items():
        results[name] = jax.jit(make_grad_fn(graphdef, lc, chunk_size=16))(params, arrays)
    loss0, grads0, sums, _ = results["off"]
    assert sums["moe/max_violation"].shape == (2,) and sums["moe/load"].shape == (2, 4)
    # load counts every non-padding token's k pairs in each sparse layer
    valid = int((batch.segment_ids > 0).sum())
    np.testing.assert_array_equal(np.asarray(sums["moe/load"]).sum(-1), [2 * valid] * 2)
    assert np.all(np.asarray(sums["moe/max_violation"]) >= 0)
    # each auxiliary loss adds coef x its (micro-batch-averaged) value, and changes the router's gradient
    np.testing.assert_allclose(results["aux"][0], loss0 + 0.1 * sums["moe/lb_loss"], rtol=1e-5)
    np.testing.assert_allclose(results["z"][0], loss0 + 0.01 * sums["moe/z_loss"], rtol=1e-5)
    g_router = np.asarray(results["z"][1]["layers"]["router"])
    assert not np.allclose(g_router, np.asarray(grads0["layers"]["router"]))

    scalars, hists = flatten_moe_metrics({**sums, "loss": loss0}, cfg.sparse_layers())
    assert set(hists) == {"moe/expert_load/layer_1", "moe/expert_load/layer_2"}
    np.testing.assert_allclose(hists["moe/expert_load/layer_2"].sum(), 1.0)
    mv = np.asarray(sums["moe/max_violation"])
    assert scalars["moe/max_violation"] == float(mv.max()) and "moe/max_violation/layer_2" in scalars


def test_max_violation_of_step_is_mean_of_micro_batches():
    a, b = np.asarray([[4.0, 0.0, 0.0, 0.0]]), np.asarray([[1.0, 1.0, 1.0, 1.0]])
    per = [float(moe.max_violation(x)[0]) for x in (a, b)]
    assert per == [3.0, 0.0]


def test_device_load_is_logged_where_experts_split_over_devices():
    """moe/device_load_max: the busiest device's pairs over the balanced share (its experts a contiguous block
    of the experts axis), worst layer and mean over layers; logged only where the experts are split (a2a, ep)."""
    from types import SimpleNamespace

    from primejax.trainer.moe_metrics import device_load_max, expert_devices

    load = np.asarray([[4.0, 4.0, 4.0, 4.0], [6.0, 4.0, 3.0, 3.0]])  # layer 2: device 0 holds 10 of 16 pairs
    np.testing.assert_allclose(device_load_max(load, 2), [1.0, 1.25])
    np.testing.assert_allclose(device_load_max(load, 4), [1.0, 1.5])
    sums = {"moe/max_violation": np.zeros(2), "moe/load": load, "moe/lb_loss": 0.0, "moe/z_loss": 0.0}
    scalars, _ = flatten_moe_metrics(sums, [1, 2], expert_devices=2)
    assert scalars["moe/device_load_max"] == 1.25 and scalars["moe/device_load_max_mean"] == 1.125
    assert "moe/device_load_max" not in flatten_moe_metrics(sums, [1, 2])[0]
    mesh = SimpleNamespace(shape={"data": 2, "fsdp": 4, "tensor": 1})
    cfg = SimpleNamespace(num_experts=8, expert_parallel="a2a")
    assert expert_devices(cfg, mesh) == 4
    assert expert_devices(SimpleNamespace(num_experts=8, expert_parallel="fsdp"), mesh) == 1
    assert expert_devices(SimpleNamespace(num_experts=0, expert_parallel="a2a"), mesh) == 1
