"""The TPU splash path (Pallas interpreter on CPU) equals the xla path: packed rows, GQA, padding, meshes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primejax.models.attention import attention, resolve_impl
from primejax.models.sharding import make_mesh
from primejax.models.splash_attention import head_axes

ROOT = Path(__file__).resolve().parents[2]


def _packed(b, t, h, k, d, seed=0):
    rng = np.random.default_rng(seed)
    q, kk, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, k, k))
    seg = np.ones((b, t), np.int32)
    seg[0, 30:], seg[0, 77:], seg[0, 150:] = 2, 3, 0  # three samples then padding
    seg[1, 100:] = 2
    return q, kk, v, jnp.asarray(seg)


def test_splash_matches_xla_on_gqa_rows_not_a_multiple_of_the_block():
    """4 query heads per kv head, 190 tokens (padded to 256 inside the kernel), packed samples + padding."""
    q, k, v, seg = _packed(2, 190, 8, 2, 64)
    w = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)
    fwd_err = float(
        jnp.abs(attention(q, k, v, seg, impl="splash", interpret=True) - attention(q, k, v, seg)).max()
    )
    assert fwd_err < 1e-5, f"splash vs xla forward: {fwd_err:.3e}"

    def loss(impl, **kw):
        return lambda q, k, v: (attention(q, k, v, seg, impl=impl, **kw) * w).sum()

    g_xla = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    g_spl = jax.grad(loss("splash", interpret=True), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g_xla, g_spl, strict=True):
        err = float(jnp.abs(a - b).max())
        assert err < 1e-4, f"splash vs xla d{name}: {err:.3e}"


def test_auto_follows_the_active_mesh_platform():
    """A step traced under a TPU mesh on a CPU host must pick the TPU kernel (tools/tpu_compile.py relies on it)."""
    with jax.set_mesh(make_mesh(fsdp=1)):
        assert resolve_impl("auto", jnp.bfloat16) == "xla"  # a CPU mesh
    assert resolve_impl("auto", jnp.bfloat16, backend="tpu") == "splash"


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): an 8-device subprocess
def test_splash_in_shard_map_matches_unsharded_xla():
    """8 emulated devices: rows over data x fsdp, heads over tensor / context (split when kv heads divide it)."""
    env = dict(
        os.environ,
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("splash_mesh_check.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"data2_fsdp2_tensor2", "fsdp2_tensor4", "fsdp4_context2"}
    for mesh, r in result.items():
        assert r["shard_map"], f"{mesh}: the kernel is not inside shard_map"
        assert r["value"] < 1e-5, f"{mesh}: sharded splash vs xla values {r['value']:.3e}"
        assert r["grad"] < 1e-4, f"{mesh}: sharded splash vs xla gradients {r['grad']:.3e}"


def test_heads_split_over_tensor_and_context_where_the_kv_heads_divide():
    """Under context parallelism the kernel takes the heads the all-to-all split, not C whole copies."""

    def mesh(**sizes):
        return types.SimpleNamespace(shape={"data": 1, "fsdp": 1, "context": 1, "tensor": 1, **sizes})

    assert head_axes(8, mesh(tensor=2, context=4)) == ("tensor", "context")
    assert head_axes(8, mesh(context=4)) == ("context",)
    assert head_axes(2, mesh(tensor=2, context=2)) == ("tensor",)  # 2 kv heads: the context copies repeat
    assert head_axes(3, mesh(tensor=2, context=2)) is None
    assert head_axes(8, mesh(fsdp=8)) is None
