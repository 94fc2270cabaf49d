"""The Gated DeltaNet's chunked rule alone, XLA scan vs the Pallas recurrence kernels, on one GPU.

    python tools/bench_deltanet.py [--tokens 16384] [--heads 32] [--dk 128] [--dv 128] [--repeats 10]

Times `models.deltanet.gated_delta_rule` (forward, and forward + backward) and the chunk recurrence alone for
each implementation, at Qwen3.5-9B's DeltaNet shape by default (32 value heads of 128, one 16k row packed with
samples of 1-4k tokens), and prints the kernels' largest difference from the XLA path (fp32, HIGHEST) relative
to its largest entry. The whole-model rows are tools/bench_moe.py's `gpu1:qwen3_5` suite.
"""

from __future__ import annotations

import argparse
import functools
import json
import time


def _time(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--impls", default="xla,pallas")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from primejax.models import deltanet, deltanet_pallas

    rng = np.random.default_rng(0)
    t, h, dk, dv = args.tokens, args.heads, args.dk, args.dv
    q = rng.standard_normal((1, t, h, dk)).astype(np.float32)
    k = rng.standard_normal((1, t, h, dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * dk**0.5
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((1, t, h, dv)).astype(np.float32)
    g = -rng.uniform(0.001, 0.2, (1, t, h)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (1, t, h)).astype(np.float32)
    lengths = rng.integers(1024, 4096, size=64)
    seg = np.repeat(np.arange(1, 65), lengths)[:t].reshape(1, t).astype(np.int32)
    x = tuple(jax.device_put(a) for a in (q, k, v, g, beta, seg))
    w = jax.device_put(rng.standard_normal((1, t, h, dv)).astype(np.float32))

    rows, outs = {}, {}
    for impl in args.impls.split(","):
        fwd = jax.jit(lambda *a, impl=impl: deltanet.gated_delta_rule(*a, impl=impl))
        grad = jax.jit(
            jax.grad(
                lambda *a, impl=impl: jnp.sum(deltanet.gated_delta_rule(*a, impl=impl) * w), argnums=(0, 1, 2)
            )
        )
        outs[impl] = (fwd(*x), grad(*x))
        rows[impl] = dict(fwd_ms=_time(fwd, x, args.repeats), fwd_bwd_ms=_time(grad, x, args.repeats))
        print(json.dumps({impl: rows[impl]}), flush=True)

    # the recurrence alone, on inputs of its shapes
    n, c = t // deltanet.CHUNK, deltanet.CHUNK
    rec_in = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in
              ((h, n, c, dv), (h, n, c, dk), (h, n, c, dk), (h, n, c, dk), (h, n, c, c))]  # fmt: skip
    rec_in = tuple(jax.device_put(a) for a in (*rec_in, rng.uniform(0.5, 1.0, (h, n)).astype(np.float32)))
    tf32x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    rec = {"xla": deltanet_pallas.chunk_recurrence_xla}
    for bv in (16, 32, 64):  # value columns per program (deltanet_pallas.BV is the default)
        name = "pallas" if bv == deltanet_pallas.BV else f"pallas_bv{bv}"
        rec[name] = functools.partial(deltanet_pallas.chunk_recurrence, precision=tf32x3, bv=bv)
    for impl in rec if "pallas" in args.impls else ("xla",):
        rows.setdefault(impl, {})
        f = jax.jit(rec[impl])
        gf = jax.jit(jax.grad(lambda *a, f=rec[impl]: jnp.sum(f(*a) ** 2), argnums=range(6)))
        rows[impl].update(
            recurrence_fwd_ms=_time(f, rec_in, args.repeats),
            recurrence_fwd_bwd_ms=_time(gf, rec_in, args.repeats),
        )
    if "xla" in outs and "pallas" in outs:
        (o_x, g_x), (o_p, g_p) = outs["xla"], outs["pallas"]
        rows["pallas"]["out_rel_diff"] = float(jnp.abs(o_p - o_x).max() / jnp.abs(o_x).max())
        rows["pallas"]["grad_rel_diff"] = max(
            float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(g_p, g_x, strict=True)
        )
    print(
        json.dumps(
            dict(device=jax.devices()[0].device_kind, shape=dict(tokens=t, heads=h, dk=dk, dv=dv), rows=rows)
        )
    )


if __name__ == "__main__":
    main()
