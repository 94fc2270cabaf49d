"""The train step on a 4-device CPU mesh (data=2 x fsdp=2) matches the single-device step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax, numpy as np
    from flax import nnx
    from conftest import random_samples, tiny_config
    from primejax.contracts.batch import pack_samples
    from primejax.models.sharding import make_mesh
    from primejax.models.transformer import init_model
    from primejax.trainer import optim
    from primejax.trainer.losses import LossConfig
    from primejax.trainer.engine import jit_train_step
    from primejax.trainer.step import (device_batch, init_state, make_train_step,
                                       to_micro_batches)

    assert jax.device_count() == 4
    cfg = tiny_config()
    sched = optim.make_schedule(1e-2)
    opt = optim.make_optimizer({"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.01,
                                "max_norm": 1.0}, sched)
    (batch,) = pack_samples(random_samples(5, 12, max_len=24), seq_len=32, pad_rows_to_multiple=8)
    results = {}
    for name, mesh in (("single", make_mesh(1, 1, 1, devices=jax.devices()[:1])), ("dp2_fsdp2", make_mesh(2, 2, 1))):
        model = init_model(cfg, mesh, seed=0)
        state = init_state(model, opt, mesh=mesh)
        step = jit_train_step(make_train_step(nnx.graphdef(model), opt, sched, LossConfig(kl_tau=0.1),
                                              chunk_size=8), state, mesh)
        rows = 2 * mesh.shape["data"] * mesh.shape["fsdp"]  # micro_batch_size 2 per data-parallel device
        with jax.set_mesh(mesh):
            state, metrics = step(state, device_batch(to_micro_batches(batch, rows), mesh))
        if name != "single":
            emb = state.params["layers"]["q_proj"]
            assert len(emb.sharding.device_set) == 4, emb.sharding
        results[name] = (jax.tree.map(np.asarray, state.params), {k: float(v) for k, v in metrics.items()})
    (p1, m1), (p4, m4) = results["single"], results["dp2_fsdp2"]
    for k in ("loss", "grad_norm", "entropy", "mismatch_kl"):
        np.testing.assert_allclose(m4[k], m1[k], rtol=1e-4, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(p4), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    print("ok")
    """
)


def test_sharded_step_matches_single_device():
    here = os.path.dirname(os.path.abspath(__file__))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
    }
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, here], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")
