"""Run in a subprocess by test_context_parallel.py with 8 emulated CPU devices (XLA flags precede jax's start).

Usage: python context_check.py OUT_JSON. Packed rows of 64 tokens whose segments straddle the 16-token
shards of a 4-way context split; the step's loss and fp32 gradients (two micro-batches, the trainer's grad
function) and two whole trainer steps on meshes with context=4 are compared with one device (context=1).
Also records how many all-to-alls the compiled context-parallel step holds (the layout switch really happens).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))  # tests/trainer/conftest helpers
from conftest import random_samples, tiny_config  # noqa: E402

from primejax.contracts.batch import pack_samples  # noqa: E402
from primejax.models.sharding import make_mesh  # noqa: E402
from primejax.models.transformer import init_model
from primejax.trainer import optim  # noqa: E402
from primejax.trainer.engine import jit_train_step
from primejax.trainer.losses import LossConfig  # noqa: E402
from primejax.trainer.step import (  # noqa: E402
    device_batch,
    init_state,
    make_grad_fn,
    make_train_step,
    to_micro_batches,
)

SEQ, CONTEXT, ROWS_PER_MICRO = 64, 4, 2
MESHES = {
    "fsdp2_context4": dict(fsdp=2, context=4),
    "context4_tensor2": dict(fsdp=1, context=4, tensor=2),
}


def _batch():
    (batch,) = pack_samples(
        random_samples(11, 9, min_len=10, max_len=40), seq_len=SEQ, pad_rows_to_multiple=4
    )
    return batch


def _straddling(batch) -> int:
    """Segments that cross a shard boundary of the context split (the case the test is about)."""
    shard = SEQ // CONTEXT
    seg = batch.segment_ids
    return int(sum(((seg[:, b - 1] == seg[:, b]) & (seg[:, b] > 0)).sum() for b in range(shard, SEQ, shard)))


def _run(mesh, cfg, batch, opt, sched):
    model = init_model(cfg, mesh, seed=0)
    graphdef = nnx.graphdef(model)
    state = init_state(model, opt, mesh=mesh)
    arrays = to_micro_batches(batch, ROWS_PER_MICRO)
    loss_cfg = LossConfig(kl_tau=0.1)
    grad_fn = jax.jit(make_grad_fn(graphdef, loss_cfg, chunk_size=8, max_segments=8))
    step = jit_train_step(
        make_train_step(graphdef, opt, sched, loss_cfg, chunk_size=8, max_segments=8), state, mesh
    )
    with jax.set_mesh(mesh):
        dev = device_batch(arrays, mesh)
        compiled = grad_fn.lower(state.params, dev).compile()
        hlo = compiled.as_text()
        loss, grads, _, _ = compiled(state.params, dev)
        losses = []
        for _ in range(2):
            state, metrics = step(state, dev)
            losses.append(float(metrics["loss"]))
    return dict(
        loss=float(loss),
        grads=jax.tree.map(np.asarray, grads),
        params=jax.tree.map(np.asarray, state.params),
        step_losses=losses,
        all_to_all=hlo.count("all-to-all-start") + hlo.count(" all-to-all("),
    )


def _max_rel(a, b) -> float:
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-12)))
    return worst


def _rel_norm(a, b) -> float:
    """Worst ||a - b|| / ||b|| over the leaves: Adam turns reduction-order noise in a ~0 gradient into an
    lr-sized step of that element, so after an update element-wise tolerances would test the noise."""
    return max(
        float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-12))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def main(out_path: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    cfg = tiny_config(hidden_size=64, num_heads=8, num_kv_heads=4, head_dim=16, intermediate_size=96)
    sched = optim.make_schedule(1e-2)
    opt = optim.make_optimizer(
        {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "max_norm": 1.0}, sched
    )
    batch = _batch()
    ref = _run(make_mesh(1, 1, 1, devices=jax.devices()[:1]), cfg, batch, opt, sched)
    result = {
        "straddling_segments": _straddling(batch),
        "rows": int(batch.rows),
        "segments_per_row": [int(r.max()) for r in batch.segment_ids],
        "meshes": {},
    }
    for name, sizes in MESHES.items():
        got = _run(make_mesh(**sizes), cfg, batch, opt, sched)
        result["meshes"][name] = dict(
            loss=got["loss"],
            ref_loss=ref["loss"],
            grads_max_rel=_max_rel(got["grads"], ref["grads"]),
            params_rel_norm=_rel_norm(got["params"], ref["params"]),
            step_losses=got["step_losses"],
            ref_step_losses=ref["step_losses"],
            all_to_all=got["all_to_all"],
        )
    result["ref_all_to_all"] = ref["all_to_all"]
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
