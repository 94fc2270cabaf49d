"""Host <-> device copy rates, one direction and both at once: inside one jitted program (how the offloaded update
moves its buckets, trainer/offload.py) and as runtime transfers (`jax.device_put` between memory kinds).

The offloaded update's profile showed the two directions taking turns (docs/benchmarks.md); this measures whether
they can run at once at all, and which way of issuing them gets that. GPU only (pinned host memory).

    python3 tools/bench_host_copies.py --gib 4 --chunks 8 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _timed(fn, reps: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile / first transfer
    t0 = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(fn())
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0, help="GiB moved per direction per device")
    ap.add_argument("--chunks", type=int, default=8, help="pieces the jitted copies are split into")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devs = jax.devices()[: args.devices]
    mesh = Mesh(np.array(devs), ("d",))
    n = int(args.gib * 2**30 / 4) // args.chunks * args.chunks * args.devices
    shape = (args.chunks, n // args.chunks)
    whole_dev = NamedSharding(mesh, PartitionSpec(None, "d"), memory_kind="device")
    whole_host = NamedSharding(mesh, PartitionSpec(None, "d"), memory_kind="pinned_host")
    x_host = jax.device_put(jnp.ones(shape, jnp.float32, device=whole_dev), whole_host)
    y_dev = jax.device_put(jnp.ones(shape, jnp.float32), whole_dev)
    jax.block_until_ready((x_host, y_dev))

    h2d = jax.jit(lambda x: jax.device_put(x, whole_dev) * 2.0, out_shardings=whole_dev)
    d2h = jax.jit(lambda y: jax.device_put(y * 2.0, whole_host), out_shardings=whole_host)
    both = jax.jit(
        lambda x, y: (jax.device_put(x, whole_dev) * 2.0, jax.device_put(y * 2.0, whole_host)),
        out_shardings=(whole_dev, whole_host),
    )
    # the same bytes as separate buffers (the update's buckets)
    piece_dev = NamedSharding(mesh, PartitionSpec("d"), memory_kind="device")
    piece_host = NamedSharding(mesh, PartitionSpec("d"), memory_kind="pinned_host")
    xs_host = [jax.device_put(jnp.ones(shape[1:], jnp.float32, device=piece_dev), piece_host) for _ in range(args.chunks)]
    ys_dev = [jnp.ones(shape[1:], jnp.float32, device=piece_dev) for _ in range(args.chunks)]
    jax.block_until_ready((xs_host, ys_dev))

    def both_pieces(xs, ys):  # independent transfers, every piece both ways
        return [jax.device_put(x, piece_dev) * 2.0 for x in xs], [jax.device_put(y * 2.0, piece_host) for y in ys]

    both_pieces = jax.jit(both_pieces)

    def pipeline(inflight):  # the offloaded update's shape: in, update, out per bucket; bucket k's copy in waits
        # on bucket k - inflight's result (trainer/offload.py)

        def f(xs):
            outs, done = [], []
            for x in xs:
                if len(done) >= inflight:
                    x, _ = jax.lax.optimization_barrier((x, done[-inflight]))
                r = jax.device_put(x, piece_dev) * 2.0 + 1.0
                done.append(r)
                outs.append(jax.device_put(r, piece_host))
            return outs

        return jax.jit(f)

    pipe1, pipe2, pipe4 = pipeline(1), pipeline(2), pipeline(4)

    def rt_h2d():
        return jax.device_put(x_host, whole_dev)

    def rt_d2h():
        return jax.device_put(y_dev, whole_host)

    def rt_both():
        return jax.device_put(x_host, whole_dev), jax.device_put(y_dev, whole_host)

    def rt_both_pieces():  # runtime transfers of each piece, both directions dispatched before any wait
        return [jax.device_put(x, piece_dev) for x in xs_host], [jax.device_put(y, piece_host) for y in ys_dev]

    gb = n * 4 / args.devices / 1e9  # per device per direction
    cases = {
        "jit h2d": lambda: h2d(x_host),
        "jit d2h": lambda: d2h(y_dev),
        "jit both": lambda: both(x_host, y_dev),
        "jit both, pieces": lambda: both_pieces(xs_host, ys_dev),
        "jit pipeline, 1 in flight": lambda: pipe1(xs_host),
        "jit pipeline, 2 in flight": lambda: pipe2(xs_host),
        "jit pipeline, 4 in flight": lambda: pipe4(xs_host),
        "runtime h2d": rt_h2d,
        "runtime d2h": rt_d2h,
        "runtime both": rt_both,
        "runtime both, pieces": rt_both_pieces,
    }
    rows = []
    for name, fn in cases.items():
        try:
            s = _timed(fn, args.reps)
            dirs = 2 if ("both" in name or "pipeline" in name) else 1
            row = dict(case=name, s=s, gb_per_dir=gb, gb_s_total=dirs * gb / s)
        except Exception as e:  # a form XLA refuses is a finding too
            row = dict(case=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        print(json.dumps(row), flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_host_copies.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(dict(r, device=devs[0].device_kind, devices=args.devices)) + "\n")
    print(f"{'case':28s} {'ms':>8s} {'GB/s (all directions)':>22s}  ({gb:.1f} GB per direction per device)")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:28s} FAIL {r['error']}")
        else:
            print(f"{r['case']:28s} {r['s'] * 1e3:8.1f} {r['gb_s_total']:22.1f}")


if __name__ == "__main__":
    main()
