"""Mixed-precision matmuls: compute-dtype operands (bf16), fp32 accumulation and results.

One place for a backend difference: XLA:CPU has no bf16 x bf16 -> f32 dot kernel inside fusions ("Unsupported
element type for DotThunk::Execute: BF16 x BF16 = F32", jax 0.10), so a bf16 step failed on CPU. There the
operands are upcast first, which gives the same products (a bf16 x bf16 product is exact in fp32) summed in
fp32; GPUs and TPUs keep the bf16 tensor-core path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accumulation_dtype(dtype) -> jnp.dtype:
    """fp32 for bf16/fp32 compute; fp64 stays fp64 (gradient checks run in x64)."""
    return jnp.promote_types(dtype, jnp.float32)


def accumulating_einsum(spec: str, a: jax.Array, b: jax.Array, acc_dtype) -> jax.Array:
    """`jnp.einsum(spec, a, b)` with `acc_dtype` accumulation and result (see the module docstring)."""
    acc = jnp.dtype(acc_dtype)
    if jax.default_backend() == "cpu" and (a.dtype != acc or b.dtype != acc):
        a, b = a.astype(acc), b.astype(acc)
    return jnp.einsum(spec, a, b, preferred_element_type=acc)
