"""The Gated DeltaNet's chunk recurrence with its sequential part as Pallas (Triton) kernels (GPU).

`models/deltanet.py` turns a row into chunks of C tokens whose within-chunk work is batched matmuls; what is
left is a recurrence over the N chunks of a row, per value head, on a state S [dk, dv] (S_0 = 0):

    u_n = nv_n - kc_n S_n                 [C, dv]
    o_n = qd_n S_n + at_n u_n             [C, dv]   (the output)
    S_{n+1} = cd_n S_n + kd_n^T u_n

On XLA this is a `lax.scan` of N steps (256 for a 16k row), each a few small batched matmuls and kernel
launches, and the same again reversed for the gradient: 29 ms forward + backward per layer at Qwen3.5-9B's
shape on an H200 (docs/benchmarks.md). Only the states are sequential. A kernel computes them (one program per
row x head and block of BV value columns, which keeps its slice of S on chip for the whole row: one launch, two
[C, dk] x [dk, BV] dots per chunk; the columns of S evolve independently, so the split needs no communication)
and writes S_n for every chunk; u and o are then batched matmuls over all chunks at once.

The gradient is the same shape of problem. With dS_N = 0, reversed over n:

    du_n = at_n^T do_n + kd_n dS_{n+1}
    dS_n = cd_n dS_{n+1} + qd_n^T do_n - kc_n^T du_n

at_n^T do_n and qd_n^T do_n need no state and are batched beforehand; a second kernel runs the two lines
above (again two dots per chunk, column-separable) and writes du_n and dS_{n+1}; the rest is batched:
d nv = du, d kc = -du S^T, d qd = do S^T, d kd = u dS_{n+1}^T, d at = do u^T, d cd = <S_n, dS_{n+1}>.

The math is fp32. The dots, in the kernels and batched, run at `precision`: on GPU TF32 x 3 (three tensor-core
passes, about fp32's accuracy; plain TF32 rounds the state to 10 mantissa bits every chunk). `interpret=True` runs the same kernels on any backend (tests/models/test_deltanet_pallas.py
compares them with the XLA scan on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BV = 32  # value columns per program: 128-wide heads give 4 programs per head (a 32-head layer fills 128 SMs)


def _dot(a, b, precision):
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _states_kernel(nv_ref, kc_ref, kd_ref, cd_ref, states_ref, *, precision, bv):
    """S_n for n = 0..N-1 (the state entering chunk n), for one row x head and BV value columns."""
    from jax.experimental import pallas as pl

    bh, j = pl.program_id(0), pl.program_id(1)
    n_chunks, dk = kc_ref.shape[1], kc_ref.shape[3]
    cols = pl.ds(j * bv, bv)

    def body(n, s):
        states_ref[bh, n, :, cols] = s
        u = nv_ref[bh, n, :, cols] - _dot(kc_ref[bh, n], s, precision)
        return s * cd_ref[bh, n] + _dot(kd_ref[bh, n].T, u, precision)

    jax.lax.fori_loop(0, n_chunks, body, jnp.zeros((dk, bv), jnp.float32))


def _dstates_kernel(a_ref, bq_ref, kc_ref, kd_ref, cd_ref, du_ref, dnext_ref, *, precision, bv):
    """du_n and dS_{n+1} for n = N-1..0, given a_n = at_n^T do_n and bq_n = qd_n^T do_n."""
    from jax.experimental import pallas as pl

    bh, j = pl.program_id(0), pl.program_id(1)
    n_chunks, dk = kc_ref.shape[1], kc_ref.shape[3]
    cols = pl.ds(j * bv, bv)

    def body(i, ds):  # ds = dS_{n+1} [dk, bv]
        n = n_chunks - 1 - i
        dnext_ref[bh, n, :, cols] = ds
        du = a_ref[bh, n, :, cols] + _dot(kd_ref[bh, n], ds, precision)
        du_ref[bh, n, :, cols] = du
        return cd_ref[bh, n] * ds + bq_ref[bh, n, :, cols] - _dot(kc_ref[bh, n].T, du, precision)

    jax.lax.fori_loop(0, n_chunks, body, jnp.zeros((dk, bv), jnp.float32))


def _problem(c: int, dk: int, dv: int, bv: int = BV) -> str:
    """Why the kernels cannot tile these sizes ('' if they can): Triton's loads need power-of-two tiles."""
    for name, size in (("chunk", c), ("key head dim", dk), ("value block", bv)):
        if size < 16 or size & (size - 1):
            return f"the DeltaNet Pallas kernel needs a power-of-two {name} >= 16, not {size}"
    if dv % bv:
        return f"the DeltaNet Pallas kernel needs the value head dim ({dv}) divisible by {bv}"
    return ""


def tileable(c: int, dk: int, dv: int, bv: int = BV) -> bool:
    return not _problem(c, dk, dv, bv)


def _check(nv, kc, bv):
    if problem := _problem(nv.shape[-2], kc.shape[-1], nv.shape[-1], bv):
        raise ValueError(problem)


def _call(kernel, grid, out_shapes, interpret, *args):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=[jax.ShapeDtypeStruct(s, jnp.float32) for s in out_shapes],
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(*args)


def _states(nv, kc, kd, cd, *, precision, interpret, bv):
    bh, n, _, dv = nv.shape
    kernel = functools.partial(_states_kernel, precision=precision, bv=bv)
    return _call(kernel, (bh, dv // bv), [(bh, n, kc.shape[-1], dv)], interpret, nv, kc, kd, cd)[0]


def _outputs(nv, kc, qd, at, states, precision):
    u = nv - jnp.einsum("bncd,bnde->bnce", kc, states, precision=precision)
    return jnp.einsum("bncd,bnde->bnce", qd, states, precision=precision) + jnp.einsum(
        "bnij,bnje->bnie", at, u, precision=precision
    ), u


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def chunk_recurrence(nv, kc, qd, kd, at, cd, precision, interpret=False, bv=BV):
    """The outputs o [BH, N, C, dv] of the recurrence in the module docstring; all inputs fp32, nv [BH, N, C, dv],
    kc / qd / kd [BH, N, C, dk], at [BH, N, C, C], cd [BH, N]."""
    return _vjp_fwd(nv, kc, qd, kd, at, cd, precision, interpret, bv)[0]


def _vjp_fwd(nv, kc, qd, kd, at, cd, precision, interpret, bv):
    _check(nv, kc, bv)
    states = _states(nv, kc, kd, cd, precision=precision, interpret=interpret, bv=bv)
    out, u = _outputs(nv, kc, qd, at, states, precision)
    return out, (kc, qd, kd, at, cd, states, u)


def _vjp_bwd(precision, interpret, bv, res, do):
    kc, qd, kd, at, cd, states, u = res
    do = do.astype(jnp.float32)
    a = jnp.einsum("bnji,bnje->bnie", at, do, precision=precision)  # at_n^T do_n
    bq = jnp.einsum("bncd,bnce->bnde", qd, do, precision=precision)  # qd_n^T do_n
    bh, dv = u.shape[0], u.shape[-1]
    kernel = functools.partial(_dstates_kernel, precision=precision, bv=bv)
    du, dnext = _call(kernel, (bh, dv // bv), [u.shape, states.shape], interpret, a, bq, kc, kd, cd)
    d_kc = -jnp.einsum("bnce,bnde->bncd", du, states, precision=precision)
    d_qd = jnp.einsum("bnce,bnde->bncd", do, states, precision=precision)
    d_kd = jnp.einsum("bnce,bnde->bncd", u, dnext, precision=precision)
    d_at = jnp.einsum("bnie,bnje->bnij", do, u, precision=precision)
    d_cd = jnp.sum(states * dnext, axis=(-2, -1))
    return du, d_kc, d_qd, d_kd, d_at, d_cd


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
