"""Run in a subprocess by test_moe_mesh.py with 8 emulated CPU devices (XLA flags must precede jax's start).

Usage: python moe_mesh_check.py HF_DIR OUT_JSON. For each expert-parallel mode and mesh, the logits, loss and
every parameter gradient of a tiny Qwen3-MoE against the single-device values, and the experts' sharding.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from primejax.models.hf_io import load_model
from primejax.models.sharding import make_mesh

CASES = {
    "fsdp@fsdp8": ("fsdp", dict(fsdp=8)),
    "ep@fsdp8": ("ep", dict(fsdp=8)),
    "ep@data2_fsdp4": ("ep", dict(data=2, fsdp=4)),
    "fsdp@data2_fsdp2_tensor2": ("fsdp", dict(data=2, fsdp=2, tensor=2)),
}


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, size=(8, 16), dtype=np.int32)
    positions = np.tile(np.arange(16, dtype=np.int32), (8, 1))
    segments = np.ones((8, 16), np.int32)
    segments[1, 12:] = 0  # padding must not count in the expert load
    return tokens, positions, segments


def _loss_and_grads(model, tokens, positions, segments):
    graphdef, params = nnx.split(model)

    def loss(p):
        m = nnx.merge(graphdef, p)
        h, stats = m.forward_with_aux(tokens, positions, segments)
        logits = jnp.einsum("btd,dv->btv", h, m.lm_head_weight())
        lp = jax.nn.log_softmax(logits, -1)
        ce = -jnp.mean(jnp.take_along_axis(lp[:, :-1], tokens[:, 1:, None], -1))
        return ce + 0.01 * jnp.sum(stats["lb_loss"]) + 0.001 * jnp.sum(stats["z_loss"]), (
            logits,
            stats["load"],
        )

    (val, (logits, load)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    flat = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(grads)}
    return float(val), np.asarray(logits), np.asarray(load), flat


def main(hf_dir: str, out_path: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    batch = _batch()
    single, _ = load_model(hf_dir, param_dtype="float32", compute_dtype="float32")
    ref_loss, ref_logits, ref_load, ref_grads = _loss_and_grads(single, *batch)
    result = {"ref_load_total": float(ref_load.sum()), "cases": {}}
    for name, (mode, sizes) in CASES.items():
        mesh = make_mesh(**sizes)
        model, _ = load_model(
            hf_dir, mesh=mesh, param_dtype="float32", compute_dtype="float32", expert_parallel=mode
        )
        with jax.set_mesh(mesh):
            loss, logits, load, grads = _loss_and_grads(model, *batch)
        spec = model.layers.experts_gate_up[...].sharding.spec
        result["cases"][name] = dict(
            loss_diff=abs(loss - ref_loss),
            logits_diff=float(np.abs(logits - ref_logits).max()),
            load_equal=bool(np.array_equal(load, ref_load)),
            grad_diff=max(float(np.abs(grads[k] - ref_grads[k]).max()) for k in ref_grads),
            experts_spec=[list(e) if isinstance(e, tuple) else e for e in spec],
        )
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
