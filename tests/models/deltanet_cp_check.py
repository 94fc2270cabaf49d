"""Run in a subprocess by test_qwen3_5.py with 4 emulated CPU devices (XLA flags must precede jax's start).

Usage: python deltanet_cp_check.py OUT_JSON [CONTEXT]. One Gated DeltaNet layer (models/deltanet.py, a tiny qwen3_5_text
layer's weights) on packed rows of 192 tokens under an fsdp 2 x context 2 mesh (each row's tokens split in two
halves of 96, across the DeltaNet's 64-token chunks; CONTEXT 4: context 4 alone, 48-token quarters, where the
2 key heads cannot be split 4 ways) against one device: the output and the gradients of every
weight and of the input. Also the collectives of the compiled context-parallel gradient: the layout switch is
all-to-alls, and no collective carries a whole row (no all-gather of the tokens, no conv halo).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from primejax.models.deltanet import gated_deltanet
from primejax.models.sharding import constrain, make_mesh
from primejax.models.tiny import TinyModelConfig
from primejax.models.transformer import init_model

T = 192
COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-to-all|all-gather|collective-permute|all-reduce|reduce-scatter)\("
)


def _cfg():
    cfg = TinyModelConfig(family="qwen3_5_text", vocab_size=128, hidden_size=64, num_heads=2).architecture()
    return dataclasses.replace(cfg, compute_dtype="float32")


def _segments() -> np.ndarray:
    seg = np.ones((2, T), np.int32)
    seg[0, 50:], seg[0, 150:] = 2, 3  # 50..149 straddles the halves (96) and the chunks (64, 128)
    seg[1, 70:], seg[1, 180:] = 2, 0  # 70..179 too, then padding
    return seg


def _layer_params(cfg, mesh) -> dict:
    model = init_model(cfg, mesh, seed=0)
    return {
        str(k[-1]): v[...][0] for k, v in nnx.to_flat_state(nnx.state(model)) if str(k[-1]).startswith("lin_")
    }


def main(out_path: str, context: int = 2) -> None:
    assert jax.device_count() == 4, jax.devices()
    cfg = _cfg()
    h = jax.random.normal(jax.random.key(0), (2, T, cfg.hidden_size), jnp.float32)
    seg = _segments()

    def loss(p, h):
        h = constrain(h, ("batch", "seq", "act_embed"))
        o = constrain(gated_deltanet(cfg, p, h, seg), ("batch", "seq", "act_embed"))
        return jnp.sum(jnp.sin(o) * (seg > 0)[..., None]), o

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    ((_, ref_o), ref_g) = jax.tree.map(np.asarray, fn(_layer_params(cfg, None), h))
    mesh = make_mesh(fsdp=4 // context, context=context)
    params = _layer_params(cfg, mesh)
    with jax.set_mesh(mesh):
        compiled = fn.lower(params, h).compile()
        ((_, o), g) = jax.tree.map(np.asarray, compiled(params, h))
    collectives = [(m.group(2), m.group(1)) for m in COLLECTIVE.finditer(compiled.as_text())]
    grads = {f"w/{k}": (g[0][k], ref_g[0][k]) for k in ref_g[0]} | {"input": (g[1], ref_g[1])}
    out = dict(
        out_diff=float(np.abs(o - ref_o)[seg > 0].max()),
        grad_diff={
            k: float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12)) for k, (a, b) in grads.items()
        },
        all_to_all=sum(op == "all-to-all" for op, _ in collectives),
        # a collective whose (per-device) result holds a whole row of T tokens: the row gathered or passed on
        whole_row=[f"{op} {shape}" for op, shape in collectives if re.search(rf"[\[,]{T}[,\]]", shape)],
    )
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
