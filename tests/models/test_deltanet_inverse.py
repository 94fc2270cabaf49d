"""The Gated DeltaNet's UT-transform inverse (deltanet.unit_lower_inverse): equal to the exact inverse, and the
layer's compiled forward and backward call no LAPACK kernel. A batched LAPACK call (jax.scipy.linalg's
triangular solve is LAPACK's trsm on XLA:CPU) hands chunks of its batch to the intra-op thread pool and waits
for them; on emulated devices every device's program runs on that one pool, so a sharded step whose devices
all sit in such a call (or in a collective waiting for one that does) never finishes: the Qwen3.5-MoE mesh
check hung this way (test_moe_mesh.py, docs/models.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primejax.models.deltanet import gated_delta_rule, unit_lower_inverse


@pytest.mark.parametrize("c", [1, 2, 16, 64])
def test_unit_lower_inverse_equals_the_exact_inverse(c):
    """Random unit lower triangular matrices with the UT transform's entry sizes (|k_beta . k| <= 1), with
    leading batch axes; the result is lower triangular with a unit diagonal."""
    rng = np.random.default_rng(c)
    t = np.tril(rng.uniform(-1, 1, size=(2, 3, c, c)), -1) + np.eye(c)
    inv = np.asarray(jax.jit(unit_lower_inverse)(jnp.asarray(t, jnp.float32)), np.float64)
    ref = np.linalg.inv(t)
    err = float(np.abs(inv - ref).max() / np.abs(ref).max())
    assert err < 1e-5, f"C={c}: relative error {err:.1e}"
    assert np.all(np.triu(inv, 1) == 0) and np.all(np.diagonal(inv, axis1=-2, axis2=-1) == 1)


def test_unit_lower_inverse_refuses_a_size_not_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        unit_lower_inverse(jnp.eye(48))


def test_deltanet_rule_forward_and_backward_call_no_lapack_kernel():
    """The value-and-gradient of the chunked rule as lowered for CPU: no custom call, no triangular solve."""
    rng = np.random.default_rng(0)
    b, t, h, dk, dv = 1, 16, 2, 8, 8  # two chunks of 8: any size would call LAPACK through the solve
    k = rng.normal(size=(b, t, h, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    args = [
        rng.normal(size=(b, t, h, dk)) / np.sqrt(dk),
        k,
        rng.normal(size=(b, t, h, dv)),
        -rng.uniform(0.0, 0.5, size=(b, t, h)),
        rng.uniform(0.0, 1.0, size=(b, t, h)),
    ]
    seg = jnp.ones((b, t), jnp.int32)

    def loss(q, k, v, g, beta):
        return jnp.sum(jnp.sin(gated_delta_rule(q, k, v, g, beta, seg, chunk=8)))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    # The lowered module (no XLA compile: fast): jax lowers LAPACK-backed ops on CPU to custom calls.
    text = grad.lower(*(jnp.asarray(x, jnp.float32) for x in args)).as_text()
    ops = [
        line.strip()[:160]
        for line in text.splitlines()
        if "custom_call" in line or "triangular_solve" in line
    ]
    assert not ops, ops[:3]  # e.g. stablehlo.custom_call @lapack_strsm_ffi
