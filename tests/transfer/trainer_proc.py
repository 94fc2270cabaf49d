"""One process of an emulated multi-process trainer (jax.distributed on CPU, 2 devices per process) that
publishes one step of weights with the trainer's own publisher (primejax.transports.weights.publish): the base model,
sharded over every process's devices, plus seeded noise (the same weights for the same seed, whatever the
process count).

    python trainer_proc.py RUN_DIR MODEL_DIR STEP --mode collective|filesystem [--receivers R]
        [--workers-per-server W] [--seed S] [--dtype float32]

Environment: PRIMEJAX_COORDINATOR_ADDRESS, PRIMEJAX_NUM_PROCESSES, PRIMEJAX_PROCESS_ID (as the trainer),
PRIMEJAX_ADMIN_TOKEN (collective). Prints one line `METRICS {json}` (the publish metrics of this process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("model_dir")
    ap.add_argument("step", type=int)
    ap.add_argument("--mode", choices=("collective", "filesystem"), required=True)
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--workers-per-server", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--export", default="parallel")
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args()

    import jax

    n = int(os.environ.get("PRIMEJAX_NUM_PROCESSES", "1"))
    if n > 1:
        jax.distributed.initialize(
            os.environ["PRIMEJAX_COORDINATOR_ADDRESS"], n, int(os.environ["PRIMEJAX_PROCESS_ID"])
        )
    from primejax.models.hf_io import load_model, param_variables
    from primejax.models.sharding import make_mesh
    from primejax.trainer.config import BroadcastConfig
    from primejax.transports.weights.publish import make_publisher

    model, cfg = load_model(a.model_dir, mesh=make_mesh(fsdp=-1), param_dtype="float32")
    perturb(model, param_variables, a.seed)
    b = BroadcastConfig(
        dtype=a.dtype,
        mode=a.mode,
        transfer_timeout_s=a.timeout,
        bucket_mb=1,
        max_shard_mb=0.05,
        export=a.export,
        workers_per_server=a.workers_per_server,
    )
    pub = make_publisher(
        b,
        a.run_dir,
        cfg,
        async_level=1,
        max_steps=a.step + 10,
        checkpoint_interval=0,
        num_receivers=a.receivers * a.workers_per_server,
        src_dir=a.model_dir,
    )
    metrics = pub.publish(a.step, model)
    print("METRICS " + json.dumps(metrics), flush=True)
    return 0


def perturb(model, param_variables, seed: int) -> None:
    """Add noise of each parameter's own scale (at least 0.1), in place, keeping every parameter's sharding."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(seed)
    for i, var in enumerate(param_variables(model).values()):
        w = var[...]

        def noisy(w, k):
            return w + jnp.maximum(w.std(), 0.1) * jax.random.normal(k, w.shape, w.dtype)

        var[...] = jax.jit(noisy, out_shardings=w.sharding)(w, jax.random.fold_in(key, i))


if __name__ == "__main__":
    sys.exit(main())
