"""The benchmarks' fake batch carries every field of the batch contract with its dtype: after the corrections
added `env_ids` and `staleness`, the benchmarks' hand-written batch lacked them and every GPU row failed with a
KeyError inside the step."""

from __future__ import annotations

import numpy as np

from primejax.contracts.batch import FIELDS
from tools.bench_trainer import _fake_batch


def test_fake_batch_has_every_contract_field():
    batch = _fake_batch(2, 16, 64, "rl")
    assert list(batch) == list(FIELDS)
    for name, dtype in FIELDS.items():
        assert np.dtype(batch[name].dtype) == dtype and batch[name].shape == (2, 16), name


def test_uniform_replayed_routing_is_distinct_and_balanced_per_device():
    """bench_moe's replayed routing (the balanced case beside random init's skew): each token's k experts are
    distinct, and summed per device's block of experts every layer's load is within a few percent of even."""
    from types import SimpleNamespace

    from tools.bench_moe import _device_load, _uniform_routing

    cfg = SimpleNamespace(num_experts=128, num_experts_per_tok=8)
    out = _uniform_routing((2, 4, 512), 3, cfg)
    experts = out["routed_experts"]
    assert experts.shape == (2, 4, 512, 3, 8) and experts.dtype == np.uint8 and out["routed_mask"].all()
    assert (np.sort(experts, -1)[..., 1:] != np.sort(experts, -1)[..., :-1]).all()
    load = np.stack([np.bincount(experts[..., layer, :].ravel(), minlength=128) for layer in range(3)])
    assert _device_load(load, 4)["layer_max_max"] < 1.03
