"""The offloaded update (trainer.optim.offload, trainer/offload.py) against the on-device AdamW update on the
machine it runs on: the fp32 master weights and both moments after a few steps, as relative errors.

Run as a `tools/bench_moe.py` row of kind "offload_check" (`--suite gpu1:checks --only offload`, or the CPU smoke
row). Every engine starts from the same parameters: a random init rounded to bfloat16, so the fp32 master of an
engine with bfloat16 compute copies (its copies exactly those values) and the fp32 parameters of the on-device
reference hold the same numbers. Each case then runs the same batch for `steps` steps, and its state is compared
with the reference's:

- "moments": fp32 parameters on the devices, the moments in pinned host memory. The same model and gradients
  as the reference, so only the bucketed update differs: the CPU tests hold it bit-equal with one bucket and
  within an ulp with split buckets (docs/memory.md).
- "master": bfloat16 compute copies, the fp32 master and moments in host memory (the fp32 rows of
  docs/benchmarks.md). The forward and backward run on bfloat16 copies where the reference casts fp32 parameters at
  use, and parameters the model reads in fp32 differ by that rounding: bf16-level differences in the
  gradients, which Adam's normalization carries into the moments and updates.
- "master_on_gpu": the same with the master on the devices, the first buckets resident, two in flight.

`ok` holds when every case is finite, "moments" is within SAME_MATH_TOL of the reference (relative L2 of the
master and of each moment), "master_on_gpu" within SAME_MATH_TOL of "master" (the same update, other placements),
and each bf16-copy case's losses within LOSS_TOL of the reference's. Their master and moments against the
reference are reported, not bounded: a router or norm that reads its weight in fp32 in the reference reads the
bf16 copy there, and a top-k choice near a tie can flip. On the tiny CPU models after 3 steps: the MoE's moments
2-4e-2 and master updates 6e-2 relative L2, losses 1.5e-3 (the router's matmul runs in fp32 in the reference);
the same model made dense, moments 0.6-1.6e-3, master updates 3.5e-5, losses equal.
"""

from __future__ import annotations

import time

# the same gradients, only the update's bucketing or placement differs (ulp-level, docs/memory.md)
SAME_MATH_TOL = 1e-6
# the bf16-copy cases' losses against the reference's, relative
LOSS_TOL = 1e-2


def _rel(a, b) -> tuple[float, float]:
    """(||a - b|| / ||b||, max |a - b|) over every leaf of two host trees, in float64."""
    import jax
    import numpy as np

    num = den = peak = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        d = np.asarray(x, np.float64) - np.asarray(y, np.float64)
        num += float(np.sum(d * d))
        den += float(np.sum(np.square(np.asarray(y, np.float64))))
        peak = max(peak, float(np.max(np.abs(d))) if d.size else 0.0)
    return (num / den) ** 0.5 if den else float(num > 0), peak


def state_trees(engine) -> dict:
    """fp32 master (or parameters), mu and nu as full host trees, whichever layout the engine keeps."""
    import jax
    import numpy as np
    import optax

    from primejax.trainer.offload import assemble

    host = lambda t: jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), t)  # noqa: E731
    st = engine.state
    if engine.offload is None:
        get = optax.tree_utils.tree_get
        return {"master": host(st.params), "mu": host(get(st.opt_state, "mu")), "nu": host(get(st.opt_state, "nu"))}
    plan, treedef = engine.offload.plan, jax.tree.structure(st.params)
    out = {"master": assemble(plan, st.opt_state["master"], treedef)}
    for field in ("mu", "nu"):
        out[field] = assemble(plan, [optax.tree_utils.tree_get(o, field) for o in st.opt_state["opt"]], treedef)
    return out


def offload_check_worker(c: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from primejax.models.sharding import make_mesh
    from primejax.models.transformer import init_model
    from primejax.trainer.config import OptimConfig, TrainerConfig
    from primejax.trainer.engine import Engine
    from tools.bench_moe import _model_config
    from tools.bench_trainer import _fake_batch

    born = time.perf_counter()
    devices = jax.devices()[: c["devices"]]
    mesh = make_mesh(fsdp=len(devices), devices=devices)
    fp32 = _model_config(dict(c, pdt="float32"))
    bf16 = _model_config(dict(c, pdt="bfloat16"))
    start = init_model(fp32, mesh, 0)
    rounded = jax.tree.map(
        lambda x: np.asarray(jax.device_get(x.astype(jnp.bfloat16).astype(jnp.float32))),
        nnx.to_pure_dict(nnx.state(start)),
    )
    del start

    def model(cfg):
        m = init_model(cfg, mesh, 0)
        state = nnx.state(m)
        leaves = nnx.to_pure_dict(state)
        nnx.replace_by_pure_dict(
            state, jax.tree.map(lambda v, x: jax.device_put(v.astype(x.dtype), x.sharding), rounded, leaves)
        )
        nnx.update(m, state)
        return m

    bucket_mb = c.get("bucket_mb", 256.0)
    cases = {
        "reference": (fp32, OptimConfig(lr=c.get("lr", 1e-5))),
        "moments": (fp32, OptimConfig(lr=c.get("lr", 1e-5), offload=True, offload_bucket_mb=bucket_mb)),
        "master": (bf16, OptimConfig(lr=c.get("lr", 1e-5), offload=True, offload_bucket_mb=bucket_mb)),
        "master_on_gpu": (
            bf16,
            OptimConfig(
                lr=c.get("lr", 1e-5), offload=True, offload_bucket_mb=bucket_mb, offload_master=False,
                offload_inflight=2, offload_resident_gib=c.get("resident_gib", 0.0),
            ),
        ),
    }  # fmt: skip
    host = _fake_batch(c["rows"], c["seq"], fp32.vocab_size, "rl")
    states, out = {}, {}
    for name, (cfg, optim) in cases.items():
        t = TrainerConfig(micro_batch_size=max(1, c["rows"] // len(devices)), logprob_chunk_size=2048, optim=optim)
        engine = Engine.create(t, cfg, model=model(cfg), mesh=mesh)  # the mesh the models are built on
        batch = engine.device_batch({k: np.asarray(v)[None] for k, v in host.items()})  # one micro-batch
        losses = [float(engine.run(batch, "rl", 1)["loss"]) for _ in range(c.get("check_steps", 3))]
        state = state_trees(engine)
        r = dict(losses=losses, buckets=0 if engine.offload is None else len(engine.offload.plan.buckets))
        del engine
        r["finite"] = all(np.isfinite(x).all() for x in jax.tree.leaves(state)) and all(map(np.isfinite, losses))
        if states:
            ref = states["reference"]
            for k in ("master", "mu", "nu"):
                r[f"{k}_rel"], r[f"{k}_max_abs"] = _rel(state[k], ref[k])
            delta = lambda s: jax.tree.map(np.subtract, s["master"], rounded)  # noqa: E731
            r["update_rel"] = _rel(delta(state), delta(ref))[0]
            ref_losses = out["reference"]["losses"]
            r["loss_rel"] = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref_losses, strict=True))
        if name == "master_on_gpu":  # against "master": only where the state rests differs
            r["vs_master_rel"] = max(_rel(state[k], states["master"][k])[0] for k in ("master", "mu", "nu"))
        if name in ("reference", "master"):
            states[name] = state
        out[name] = r
        print(f"PROGRESS {name} at {time.perf_counter() - born:.0f}s", flush=True)
    ok = (
        all(r["finite"] for r in out.values())
        and all(out["moments"][f"{k}_rel"] <= SAME_MATH_TOL for k in ("master", "mu", "nu"))
        and out["master_on_gpu"]["vs_master_rel"] <= SAME_MATH_TOL
        and all(out[n]["loss_rel"] <= LOSS_TOL for n in ("master", "master_on_gpu"))
    )
    return dict(
        cases=out, ok=ok, same_math_tol=SAME_MATH_TOL, loss_tol=LOSS_TOL, device=str(jax.devices()[0].device_kind),
        params=fp32.num_params(),
    )  # fmt: skip


def table(r: dict) -> list[str]:
    """The check's lines for tools/bench_moe.py's table."""
    if r.get("error"):
        return [f"offload check: FAIL {r['error'][-600:]}"]
    out = [
        f"offloaded update vs on-device ({r['device']}, {r['params'] / 1e9:.2f}B params): ok={r['ok']} "
        f"(relative L2; same math <= {r['same_math_tol']:.0e}, bf16-copy losses <= {r['loss_tol']:.0e})"
    ]
    for name, v in r["cases"].items():
        line = f"  {name:<14} buckets {v['buckets']:>3}  losses {', '.join(f'{x:.6f}' for x in v['losses'])}"
        if name != "reference":
            line += (
                f"  master {v['master_rel']:.1e} (max {v['master_max_abs']:.1e})  mu {v['mu_rel']:.1e}"
                f"  nu {v['nu_rel']:.1e}  update {v['update_rel']:.1e}  loss {v['loss_rel']:.1e}"
            )
        if "vs_master_rel" in v:
            line += f"  vs master {v['vs_master_rel']:.1e}"
        out.append(line)
    return out
