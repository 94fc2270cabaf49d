"""Run in a subprocess by test_qwen3_5.py with 8 emulated CPU devices (XLA flags must precede jax's start).

Usage: python qwen3_5_mesh_check.py OUT_JSON HF_DIR [tensor|context]. The tiny Qwen3.5 hybrid's logits, loss
and every parameter gradient on packed rows (segments crossing the 64-token DeltaNet chunks) against one device,
with the DeltaNet weights' shardings: `tensor` (default) a data x fsdp x tensor mesh; `context` two meshes that
split each row's tokens (context 2 and 4: 48- and 24-token shards, segments straddling them), two whole trainer
steps on the first, and the one-line refusal of tensor x context = 8 for the model's 4 DeltaNet value heads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from primejax.models.hf_io import load_model
from primejax.models.sharding import make_mesh

MESHES = {
    "tensor": {"data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2)},
    "context": {
        "data2_fsdp2_context2": dict(data=2, fsdp=2, context=2),
        "data2_context4": dict(data=2, context=4),
    },
}
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


def _train_steps(cfg, mesh) -> tuple[list[float], dict]:
    """Two trainer steps (trainer/step.py, as the trainer compiles them) on packed samples from one init."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))  # tests/trainer/conftest helpers
    from conftest import random_samples

    from primejax.contracts.batch import pack_samples
    from primejax.models.transformer import init_model
    from primejax.trainer import optim
    from primejax.trainer.engine import jit_train_step
    from primejax.trainer.losses import LossConfig
    from primejax.trainer.step import device_batch, init_state, make_train_step, to_micro_batches

    sched = optim.make_schedule(1e-2)
    opt = optim.make_optimizer(
        {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "max_norm": 1.0}, sched
    )
    (batch,) = pack_samples(random_samples(11, 9, min_len=20, max_len=90), seq_len=96, pad_rows_to_multiple=8)
    model = init_model(cfg, mesh, seed=0)
    state = init_state(model, opt, mesh=mesh)
    fn = make_train_step(
        nnx.graphdef(model), opt, sched, LossConfig(kl_tau=0.1), chunk_size=8, max_segments=8
    )
    step = jit_train_step(fn, state, mesh)
    losses = []
    with jax.set_mesh(mesh):
        dev = device_batch(to_micro_batches(batch, 4), mesh)  # 4 rows: one per data x fsdp rank
        for _ in range(2):
            state, metrics = step(state, dev)
            losses.append(float(metrics["loss"]))
    return losses, jax.tree.map(np.asarray, state.params)


def main(out_path: str, hf_dir: str, which: str = "tensor") -> None:
    assert jax.device_count() == 8, jax.devices()
    batch = _batch()
    valid = batch[2] > 0
    ref_loss, ref_logits, ref_grads = _loss_and_grads(load_model(hf_dir, **FP32)[0], *batch)
    out = {"cases": {}}
    for name, sizes in MESHES[which].items():
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
    if which == "context":
        cfg = load_model(hf_dir, **FP32)[1]
        ref_losses, ref_params = _train_steps(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]))
        losses, params = _train_steps(cfg, make_mesh(data=2, fsdp=2, context=2))
        out["steps"] = dict(
            losses=losses,
            ref_losses=ref_losses,
            # ||a - b|| / ||b||: Adam turns reduction-order noise in a ~0 gradient into an lr-sized step
            params_rel_norm=max(
                float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))
                for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
            ),
        )
        mesh = make_mesh(data=1, fsdp=1, context=4, tensor=2)
        model, _ = load_model(hf_dir, mesh=mesh, **FP32)
        try:
            with jax.set_mesh(mesh):
                _loss_and_grads(model, *batch)
            out["context_error"] = None
        except ValueError as e:
            out["context_error"] = str(e)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
