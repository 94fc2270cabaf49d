"""The Gated DeltaNet's Pallas chunk recurrence (models/deltanet_pallas.py) against the XLA scan, interpreted on
CPU (the kernels' GPU timing is in docs/benchmarks.md): the recurrence's outputs and all six gradients, the whole
chunked rule on packed rows, and the per-device shard_map under an emulated mesh."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primejax.models.deltanet import gated_delta_rule
from primejax.models.deltanet_pallas import chunk_recurrence, chunk_recurrence_xla

HI = jax.lax.Precision.HIGHEST


def _rel(a, b) -> float:
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


def test_recurrence_kernels_equal_the_scan_with_gradients():
    """Forward and backward kernels (value columns in 2 blocks, so the per-block gradient partials are summed)
    give the scan's outputs and the gradients of all six inputs (fp32; measured <= 3e-7 relative)."""
    rng = np.random.default_rng(0)
    bh, n, c, dk, dv = 3, 5, 16, 32, 64

    def f(*shape):
        return jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.float32)

    args = (f(bh, n, c, dv), f(bh, n, c, dk), f(bh, n, c, dk), f(bh, n, c, dk), f(bh, n, c, c))
    args += (jnp.asarray(rng.uniform(0.5, 1.0, (bh, n)), jnp.float32),)
    w = f(bh, n, c, dv)

    def kernel(*a):
        return chunk_recurrence(*a, HI, True, 32)

    assert _rel(kernel(*args), chunk_recurrence_xla(*args)) <= 1e-6
    grads = jax.grad(lambda *a: jnp.sum(kernel(*a) * w), argnums=range(6))(*args)
    ref = jax.grad(lambda *a: jnp.sum(chunk_recurrence_xla(*a) * w), argnums=range(6))(*args)
    for name, g, r in zip(("nv", "kc", "qd", "kd", "at", "cd"), grads, ref, strict=True):
        assert _rel(g, r) <= 1e-6, name


def test_refuses_shapes_the_kernel_cannot_tile():
    x = jnp.zeros((1, 2, 16, 48), jnp.float32)
    with pytest.raises(ValueError, match="value head dim"):
        chunk_recurrence(x, jnp.zeros((1, 2, 16, 32)), jnp.zeros((1, 2, 16, 32)), jnp.zeros((1, 2, 16, 32)),
                         jnp.zeros((1, 2, 16, 16)), jnp.zeros((1, 2)), HI, True, 32)  # fmt: skip


def test_auto_picks_the_xla_scan_where_the_kernels_cannot_tile(monkeypatch):
    """On a GPU, `auto` means the kernels only for head sizes they tile; elsewhere the XLA scan."""
    from primejax.models import deltanet

    assert deltanet.resolve_impl("auto") == "xla"  # no GPU here
    monkeypatch.setattr(
        jax, "devices", lambda: [type("D", (), {"platform": "gpu", "compute_capability": "9.0"})()]
    )
    assert deltanet.resolve_impl("auto", 64, 128, 128) == "pallas"
    assert (
        deltanet.resolve_impl("auto", 64, 96, 128) == "xla"
        and deltanet.resolve_impl("auto", 64, 128, 80) == "xla"
    )
    monkeypatch.setattr(
        jax, "devices", lambda: [type("D", (), {"platform": "gpu", "compute_capability": "7.5"})()]
    )
    assert deltanet.resolve_impl("auto", 64, 128, 128) == "xla"  # no TF32 before Ampere


def _inputs(b=2, t=150, h=1, dk=32, dv=32, seed=1):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, dk)).astype(np.float32)
    k = rng.standard_normal((b, t, h, dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * dk**0.5
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, h, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, (b, t, h)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (b, t, h)).astype(np.float32)
    seg = np.ones((b, t), np.int32)
    seg[0, 40:], seg[0, 100:], seg[0, 140:] = (
        2,
        3,
        0,
    )  # resets inside chunks, across the chunk boundary, padding
    seg[1, 64:] = 2  # a reset exactly at a chunk start
    return tuple(map(jnp.asarray, (q, k, v, g, beta, seg)))


# extended tier: the whole-model test below covers the same resets and padding through every parameter gradient
@pytest.mark.slow
def test_chunked_rule_on_packed_rows_equals_the_xla_path_with_gradients():
    """The whole chunked rule (150 tokens: 3 chunks of 64, the last padded; segment resets mid-chunk and at a
    chunk start) gives the XLA path's output and gradients for q, k, v, g and beta."""
    *x, seg = _inputs()
    w = jnp.asarray(np.random.default_rng(2).standard_normal((2, 150, 1, 32)), jnp.float32)

    def loss(impl, *a):
        return jnp.sum(gated_delta_rule(*a, seg, impl=impl) * w)

    assert (
        _rel(gated_delta_rule(*x, seg, impl="pallas_interpret"), gated_delta_rule(*x, seg, impl="xla"))
        <= 1e-6
    )
    got = jax.grad(lambda *a: loss("pallas_interpret", *a), argnums=range(5))(*x)
    ref = jax.grad(lambda *a: loss("xla", *a), argnums=range(5))(*x)
    for name, g, r in zip(("q", "k", "v", "g", "beta"), got, ref, strict=True):
        assert _rel(g, r) <= 1e-5, name


_MESH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    sys.path.insert(0, sys.argv[1])
    from tests.models.test_deltanet_pallas import _inputs
    from primejax.models.deltanet import gated_delta_rule
    from primejax.models.sharding import make_mesh

    *x, seg = _inputs(b=2, t=150, h=4)
    ref = gated_delta_rule(*x, seg, impl="xla")
    out = {}
    for name, sizes in {"fsdp2_tensor2": dict(fsdp=2, tensor=2), "fsdp2_context2": dict(fsdp=2, context=2)}.items():
        fn = jax.jit(lambda *a: gated_delta_rule(*a, impl="pallas_interpret"))
        with jax.set_mesh(make_mesh(data=1, **sizes)):
            hlo = fn.lower(*x, seg).as_text()
            got = fn(*x, seg)
        out[name] = dict(diff=float(jnp.abs(got - ref).max() / jnp.abs(ref).max()),
                         shard_map="shmap" in hlo or "shard_map" in hlo or "manual" in hlo)
    print(json.dumps(out))
    """
)


def test_kernels_run_per_device_under_a_mesh():
    """fsdp 2 x tensor 2 and fsdp 2 x context 2 (4 emulated devices): rows split over fsdp, heads over tensor or
    context (the DeltaNet's whole-row layout), the kernels inside a shard_map (a Pallas call is opaque to XLA's
    partitioner); equal to one device's XLA path."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT, root], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert set(res) == {"fsdp2_tensor2", "fsdp2_context2"}
    for r in res.values():
        assert r["diff"] <= 1e-6 and r["shard_map"], res


@pytest.mark.parametrize("remat", ["full"])
def test_tiny_qwen3_5_with_the_kernels_equals_the_xla_path(remat, hf_model_dir, monkeypatch):
    """The kernels inside the whole model (the tiny Qwen3.5 hybrid, fp32, remat `full` so the custom VJP is
    re-run under rematerialization): logits, loss and every parameter gradient equal the XLA path's."""
    from flax import nnx

    from primejax.models import deltanet
    from primejax.models.hf_io import load_model

    model_dir, _ = hf_model_dir("qwen3_5_hybrid")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, size=(2, 96), dtype=np.int32)
    segments = np.ones((2, 96), np.int32)
    segments[0, 30:], segments[1, 64:] = 2, 2  # a reset mid-chunk, one at a chunk start; 96 pads to 128
    positions = np.zeros_like(tokens)
    for r in range(2):
        for s in np.unique(segments[r]):
            idx = np.flatnonzero(segments[r] == s)
            positions[r, idx] = np.arange(len(idx))

    def run(impl):
        monkeypatch.setattr(deltanet, "resolve_impl", lambda *_a, **_k: impl)
        model = load_model(model_dir, param_dtype="float32", compute_dtype="float32", remat_policy=remat)[0]
        graphdef, params = nnx.split(model)

        def loss(p):
            logits = nnx.merge(graphdef, p).logits(tokens, positions, segments)
            lp = jax.nn.log_softmax(logits, -1)
            nll = -jnp.take_along_axis(lp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
            return jnp.mean(nll), logits

        (val, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return float(val), np.asarray(logits), {k: np.asarray(v) for k, v in nnx.to_flat_state(grads)}

    from primejax.models import deltanet_pallas

    kernel_calls = []
    real = deltanet_pallas.chunk_recurrence
    monkeypatch.setattr(
        deltanet_pallas, "chunk_recurrence", lambda *a, **k: kernel_calls.append(1) or real(*a, **k)
    )
    loss_x, logits_x, grads_x = run("xla")
    assert not kernel_calls
    loss_p, logits_p, grads_p = run("pallas_interpret")
    assert kernel_calls  # the DeltaNet layers ran the kernels
    assert abs(loss_p - loss_x) <= 1e-6 and np.abs(logits_p - logits_x).max() <= 1e-5
    worst = max(float(np.abs(grads_p[k] - g).max() / max(np.abs(g).max(), 1e-12)) for k, g in grads_x.items())
    assert worst <= 1e-5, worst
    assert any("lin_" in "/".join(map(str, k)) for k in grads_x)  # the DeltaNet weights are among them
