"""Run in a subprocess by test_qwen3_5.py with 8 emulated CPU devices (XLA flags must precede jax's start).

Usage: python qwen3_5_mesh_check.py HF_DIR OUT_JSON. The tiny Qwen3.5 hybrid's logits, loss and every
parameter gradient on packed rows (segments crossing the 64-token DeltaNet chunks) under FSDP and tensor
parallel mesh against one device, the DeltaNet weights' shardings, and the one-line refusal of a mesh
that splits rows by token (context parallelism).
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

MESHES = {"data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2)}
FP32 = dict(param_dtype="float32", compute_dtype="float32")


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, size=(4, 96), dtype=np.int32)
    segments = np.ones((4, 96), np.int32)
    segments[0, 30:], segments[0, 80:] = 2, 0  # a sample crossing the chunk boundary, then padding
    segments[2, 60:] = 2
    positions = np.zeros_like(tokens)
    for r in range(4):
        for s in np.unique(segments[r]):
            idx = np.flatnonzero(segments[r] == s)
            positions[r, idx] = np.arange(len(idx))
    return tokens, positions, segments


def _loss_and_grads(model, tokens, positions, segments):
    graphdef, params = nnx.split(model)

    def loss(p):
        m = nnx.merge(graphdef, p)
        logits = m.logits(tokens, positions, segments)
        lp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(lp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
        valid = (segments[:, 1:] > 0) & (segments[:, 1:] == segments[:, :-1])
        return jnp.sum(nll * valid) / jnp.sum(valid), logits

    (val, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    flat = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(grads)}
    return float(val), np.asarray(logits), flat


def main(hf_dir: str, out_path: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    batch = _batch()
    valid = batch[2] > 0
    ref_loss, ref_logits, ref_grads = _loss_and_grads(load_model(hf_dir, **FP32)[0], *batch)
    out = {"cases": {}}
    for name, sizes in MESHES.items():
        mesh = make_mesh(**sizes)
        model, _ = load_model(hf_dir, mesh=mesh, **FP32)
        with jax.set_mesh(mesh):
            loss, logits, grads = _loss_and_grads(model, *batch)
        grad_diff = max(
            float(np.abs(grads[k] - g).max() / max(np.abs(g).max(), 1e-12)) for k, g in ref_grads.items()
        )
        out["cases"][name] = dict(
            logits_diff=float(np.abs(logits - ref_logits)[valid].max()),
            loss_diff=abs(loss - ref_loss),
            grad_diff=grad_diff,
            lin_z_spec=[str(a) for a in model.layers.lin_z[...].sharding.spec],
            lin_out_spec=[str(a) for a in model.layers.lin_out[...].sharding.spec],
        )
    mesh = make_mesh(data=2, fsdp=1, context=4)
    model, _ = load_model(hf_dir, mesh=mesh, **FP32)
    try:
        with jax.set_mesh(mesh):
            _loss_and_grads(model, *batch)
        out["context_error"] = None
    except NotImplementedError as e:
        out["context_error"] = str(e)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
