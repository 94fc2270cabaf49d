"""The Gated DeltaNet's chunk recurrence as Pallas (Triton) kernels, forward and backward (GPU).

`models/deltanet.py` turns a row into chunks of C tokens whose within-chunk work is batched matmuls; what is
left is a recurrence over the N chunks of a row, per value head, on a state S [dk, dv] (S_0 = 0):

    u_n = nv_n - kc_n S_n                 [C, dv]
    o_n = qd_n S_n + at_n u_n             [C, dv]   (the output)
    S_{n+1} = cd_n S_n + kd_n^T u_n

On XLA this is a `lax.scan` of N steps, each a few batched [C, dk] x [dk, dv] matmuls over all heads: 256
steps for a 16k row, each step several kernel launches of tiny matmuls, and the same again (reversed) for the
gradient. Here one program per (row x head, block of BV value columns) keeps its slice of the state on chip for
the whole row: one launch, N iterations of [C, dk] x [dk, BV] tensor-core dots. The columns of S evolve
independently (every product above reads S or u column by column), so the dv split needs no communication.

The backward runs the recurrence in reverse with dS_N = 0:

    du_n = at_n^T do_n + kd_n dS_{n+1}
    dS_n = cd_n dS_{n+1} + qd_n^T do_n - kc_n^T du_n
    d nv_n = du_n, d kc_n = -du_n S_n^T, d qd_n = do_n S_n^T, d kd_n = u_n dS_{n+1}^T, d at_n = do_n u_n^T,
    d cd_n = <S_n, dS_{n+1}>

reading the entering states S_n that the forward stored (N x dk x dv per head, fp32). The gradients that sum
over dv (all but d nv) come out per BV block and are summed after the kernel.

The math is fp32. The dots run at `precision`: on GPU the default is TF32 x 3 (three tensor-core passes, about
fp32's accuracy; plain TF32 rounds the state to 10 mantissa bits every chunk). `interpret=True` runs the same
kernels on any backend (tests/models/test_deltanet_pallas.py compares them with the XLA scan on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BV = 64  # value columns per program


def _dot(a, b, precision):
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _fwd_kernel(nv_ref, kc_ref, qd_ref, kd_ref, at_ref, cd_ref, out_ref, states_ref, *, precision, bv):
    from jax.experimental import pallas as pl

    bh, j = pl.program_id(0), pl.program_id(1)
    n_chunks, dk = kc_ref.shape[1], kc_ref.shape[3]
    cols = pl.ds(j * bv, bv)

    def body(n, s):
        states_ref[bh, n, :, cols] = s
        u = nv_ref[bh, n, :, cols] - _dot(kc_ref[bh, n], s, precision)
        out_ref[bh, n, :, cols] = _dot(qd_ref[bh, n], s, precision) + _dot(at_ref[bh, n], u, precision)
        return s * cd_ref[bh, n] + _dot(kd_ref[bh, n].T, u, precision)

    jax.lax.fori_loop(0, n_chunks, body, jnp.zeros((dk, bv), jnp.float32))


def _bwd_kernel(
    nv_ref, kc_ref, qd_ref, kd_ref, at_ref, cd_ref, states_ref, do_ref,
    dnv_ref, dkc_ref, dqd_ref, dkd_ref, dat_ref, dcd_ref, *, precision, bv,
):  # fmt: skip
    from jax.experimental import pallas as pl

    bh, j = pl.program_id(0), pl.program_id(1)
    n_chunks, dk = kc_ref.shape[1], kc_ref.shape[3]
    cols = pl.ds(j * bv, bv)

    def body(i, ds):  # ds = dS_{n+1} [dk, bv]
        n = n_chunks - 1 - i
        s = states_ref[bh, n, :, cols]
        kc, qd, kd, at = kc_ref[bh, n], qd_ref[bh, n], kd_ref[bh, n], at_ref[bh, n]
        do = do_ref[bh, n, :, cols]
        u = nv_ref[bh, n, :, cols] - _dot(kc, s, precision)
        du = _dot(at.T, do, precision) + _dot(kd, ds, precision)
        dnv_ref[bh, n, :, cols] = du
        dkc_ref[j, bh, n] = -_dot(du, s.T, precision)
        dqd_ref[j, bh, n] = _dot(do, s.T, precision)
        dkd_ref[j, bh, n] = _dot(u, ds.T, precision)
        dat_ref[j, bh, n] = _dot(do, u.T, precision)
        dcd_ref[j, bh, n] = jnp.sum(s * ds)
        return cd_ref[bh, n] * ds + _dot(qd.T, do, precision) - _dot(kc.T, du, precision)

    jax.lax.fori_loop(0, n_chunks, body, jnp.zeros((dk, bv), jnp.float32))


def _check(nv, kc, bv):
    dv, c = nv.shape[-1], nv.shape[-2]
    for name, size in (("chunk", c), ("key head dim", kc.shape[-1]), ("value block", bv)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"the DeltaNet Pallas kernel needs a power-of-two {name} >= 16, not {size}")
    if dv % bv:
        raise ValueError(f"the DeltaNet Pallas kernel needs the value head dim ({dv}) divisible by {bv}")


def _params(num_warps):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def _forward(nv, kc, qd, kd, at, cd, *, precision, interpret, bv):
    from jax.experimental import pallas as pl

    bh, n, c, dv = nv.shape
    dk = kc.shape[-1]
    kernel = functools.partial(_fwd_kernel, precision=precision, bv=bv)
    return pl.pallas_call(
        kernel,
        grid=(bh, dv // bv),
        out_shape=(
            jax.ShapeDtypeStruct((bh, n, c, dv), jnp.float32),
            jax.ShapeDtypeStruct((bh, n, dk, dv), jnp.float32),
        ),
        interpret=interpret,
        compiler_params=None if interpret else _params(4),
    )(nv, kc, qd, kd, at, cd)


def _backward(nv, kc, qd, kd, at, cd, states, do, *, precision, interpret, bv):
    from jax.experimental import pallas as pl

    bh, n, c, dv = nv.shape
    dk, nj = kc.shape[-1], dv // bv
    kernel = functools.partial(_bwd_kernel, precision=precision, bv=bv)
    f32 = jnp.float32
    dnv, dkc, dqd, dkd, dat, dcd = pl.pallas_call(
        kernel,
        grid=(bh, nj),
        out_shape=(
            jax.ShapeDtypeStruct((bh, n, c, dv), f32),
            jax.ShapeDtypeStruct((nj, bh, n, c, dk), f32),
            jax.ShapeDtypeStruct((nj, bh, n, c, dk), f32),
            jax.ShapeDtypeStruct((nj, bh, n, c, dk), f32),
            jax.ShapeDtypeStruct((nj, bh, n, c, c), f32),
            jax.ShapeDtypeStruct((nj, bh, n), f32),
        ),
        interpret=interpret,
        compiler_params=None if interpret else _params(8),
    )(nv, kc, qd, kd, at, cd, states, do)
    return dnv, *(x.sum(0) for x in (dkc, dqd, dkd, dat, dcd))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def chunk_recurrence(nv, kc, qd, kd, at, cd, precision, interpret=False, bv=BV):
    """The outputs o [BH, N, C, dv] of the recurrence in the module docstring; all inputs fp32, nv [BH, N, C, dv],
    kc / qd / kd [BH, N, C, dk], at [BH, N, C, C], cd [BH, N]."""
    _check(nv, kc, bv)
    return _forward(nv, kc, qd, kd, at, cd, precision=precision, interpret=interpret, bv=bv)[0]


def _vjp_fwd(nv, kc, qd, kd, at, cd, precision, interpret, bv):
    _check(nv, kc, bv)
    out, states = _forward(nv, kc, qd, kd, at, cd, precision=precision, interpret=interpret, bv=bv)
    return out, (nv, kc, qd, kd, at, cd, states)


def _vjp_bwd(precision, interpret, bv, res, do):
    return _backward(*res, do.astype(jnp.float32), precision=precision, interpret=interpret, bv=bv)


chunk_recurrence.defvjp(_vjp_fwd, _vjp_bwd)


def chunk_recurrence_xla(nv, kc, qd, kd, at, cd, precision=jax.lax.Precision.HIGHEST):
    """The same recurrence as a `lax.scan` over chunks (the portable path, and the kernels' reference)."""

    def step(state, xs):  # state [BH, dk, dv]
        nv_n, kc_n, qd_n, kd_n, at_n, cd_n = xs
        u = nv_n - jnp.einsum("bcd,bde->bce", kc_n, state, precision=precision)
        out = jnp.einsum("bcd,bde->bce", qd_n, state, precision=precision) + jnp.einsum(
            "bij,bje->bie", at_n, u, precision=precision
        )
        state = state * cd_n[:, None, None] + jnp.einsum("bcd,bce->bde", kd_n, u, precision=precision)
        return state, out

    bh, dk, dv = kc.shape[0], kc.shape[-1], nv.shape[-1]
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (nv, kc, qd, kd, at, cd))
    _, out = jax.lax.scan(step, jnp.zeros((bh, dk, dv), jnp.float32), xs)
    return jnp.moveaxis(out, 0, 1)
