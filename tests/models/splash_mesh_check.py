"""Run in a subprocess by test_splash_attention.py with 8 emulated CPU devices (XLA flags precede jax's start).

Usage: python splash_mesh_check.py. Prints one JSON line: per mesh, the max difference of the sharded
splash path (Pallas interpreter, in shard_map) from the unsharded xla path, for values and gradients.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from primejax.models.attention import attention
from primejax.models.sharding import make_mesh

# kv heads 2: tensor=2 splits heads inside shard_map, tensor=4 cannot (heads stay whole on each device),
# context=2 splits them over the context axis (the layout context parallelism hands attention).
MESHES = {
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "fsdp2_tensor4": dict(fsdp=2, tensor=4),
    "fsdp4_context2": dict(fsdp=4, context=2),
}
B, T, H, K, D = 4, 128, 8, 2, 32


def _inputs():
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, D)), jnp.float32) for n in (H, K, K))
    seg = np.ones((B, T), np.int32)
    seg[0, 40:], seg[0, 90:], seg[1, 64:], seg[2, 10:], seg[2, 20:], seg[2, 120:] = 2, 0, 2, 2, 3, 0
    return q, k, v, jnp.asarray(seg)


def _loss(impl, seg, **kw):
    w = jnp.asarray(
        np.random.default_rng(2).normal(size=(B, T, H, D)), jnp.float32
    )  # non-symmetric cotangent
    return lambda q, k, v: (attention(q, k, v, seg, impl=impl, **kw) * w).sum()


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    q, k, v, seg = _inputs()
    ref = attention(q, k, v, seg, impl="xla")
    ref_grads = jax.grad(_loss("xla", seg), argnums=(0, 1, 2))(q, k, v)
    result = {}
    for name, sizes in MESHES.items():
        mesh = make_mesh(**sizes)
        with jax.set_mesh(mesh):
            out = jax.jit(lambda q, k, v, s: attention(q, k, v, s, impl="splash", interpret=True))(
                q, k, v, seg
            )
            grads = jax.jit(jax.grad(_loss("splash", seg, interpret=True), argnums=(0, 1, 2)))(q, k, v)
            text = (
                jax.jit(lambda q, k, v, s: attention(q, k, v, s, impl="splash", interpret=True))
                .lower(q, k, v, seg)
                .as_text()
            )
        result[name] = {
            "value": float(jnp.abs(out - ref).max()),
            "grad": max(float(jnp.abs(a - b).max()) for a, b in zip(grads, ref_grads, strict=True)),
            "shard_map": "shard_map" in text or "sdy.manual_computation" in text,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
