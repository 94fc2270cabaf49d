"""Qwen3-MoE on GPUs: grouped-matmul checks and speed, then the full RL trainer step, one table at the end.

    python tools/bench_moe.py                  # 1 GPU: 30B-A3B cut to 4, 8 and 10 layers at 16k
    python tools/bench_moe.py --suite gpu4:ep  # 4 GPUs: 48-layer 30B-A3B, expert parallelism by all-to-all vs fsdp
    python tools/bench_moe.py --smoke          # CPU, tiny shapes (proves the script before GPU time is spent)

`--help` lists every suite; each suite's rows, with what they compare, are in tools/bench_moe_suites.py (checks of
the grouped matmul, expert-parallel modes, context parallelism, offload, GLM / DeepSeek / Qwen3.5 shapes, LoRA).
Each step configuration runs in its own process (an OOM stays
contained). The step is the trainer's own
(built and compiled by the trainer engine, primejax/trainer/engine.py), fake full rows of random tokens, RL loss
over every token. MFU: prime-rl's formula over active parameters (`ModelConfig.flops_per_token`: 6 x active
matmul params + 12 L H (D/H) T; GLM-4.5 uses its head width, 12 L H Dh T, and counts its shared expert as
active) at 989
TFLOP/s bf16 per GPU; `MFU/2attn` halves the attention term (causal).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench_moe_suites import CONFIGS, PEAK_FLOPS, SHAPES  # noqa: E402
from tools.bench_trainer_profile import _timed, bench_main, lora_options, rel, time_engine_step  # noqa: E402

# ------------------------------------------------------------------------------------------------ gmm worker


def _sizes(kind: str, m: int, g: int, rng):
    import numpy as np

    if kind == "uniform":
        p = np.ones(g)
    elif kind == "skewed":  # one expert takes ~90% of the rows
        p = np.full(g, 0.1 / (g - 1))
        p[3] = 0.9
    else:  # "empty": half of the experts get nothing, including the first and the last
        p = np.where(np.arange(g) % 2 == 1, 1.0, 0.0)
    counts = rng.multinomial(m, p / p.sum())
    return counts.astype(np.int32)


def gmm_worker(c: dict) -> dict:
    """mgpu vs xla grouped matmul: values and both gradients on uniform/skewed/empty routing; then speed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from primejax.models.gmm import adapter_grouped_matmul, grouped_matmul, resolve_impl

    fast = resolve_impl("auto")
    smoke = c.get("smoke", False)
    rng = np.random.default_rng(0)
    checks = []
    # xla's ragged_dot is a dense masked matmul on GPU (G x the work): checks stay small enough for it
    m, k, n, g = (256, 128, 128, 8) if smoke else (4096, 512, 256, 16)
    # "partial": groups cover 3/4 of the rows (the ep mode's case; the rest must come out zero), the others
    # cover all rows and run with all_rows_grouped=True (no select for the rows past the groups)
    # the base's matmuls, then a rank-16 LoRA factor's two (rank as N, then as K: padded to the tiles on mgpu)
    cases = [(kind, "base", k, n) for kind in ("uniform", "skewed", "empty", "partial")]
    cases += [
        (kind, op, kk, nn)
        for kind in ("uniform", "partial")
        for op, kk, nn in (("lora_a", k, 16), ("lora_b", 16, n))
    ]
    for kind, op, k, n in cases:
        gmm = grouped_matmul if op == "base" else adapter_grouped_matmul
        full = kind != "partial"
        sizes = jnp.asarray(_sizes("uniform" if not full else kind, m * 3 // 4 if not full else m, g, rng))
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
        dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)

        def fwd_grads(f, x, w):  # f's values and both gradients of sum(f(x, w) * dy)
            cot = dy.astype(jnp.float32)  # noqa: B023
            grad = jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * cot), argnums=(0, 1))
            return (jax.jit(f)(x, w), *jax.jit(grad)(x, w))

        def err(a, b):
            return dict(zip(("y", "dx", "dw"), (rel(p, q) for p, q in zip(a, b, strict=True)), strict=True))

        outs = {
            i: fwd_grads(lambda x, w, i=i: gmm(x, w, sizes, i, all_rows_grouped=full), x, w)  # noqa: B023
            for i in ("xla", fast)
        }
        # fp32 reference on upcast inputs
        f32 = x.astype(jnp.float32), w.astype(jnp.float32)
        ref = fwd_grads(lambda x, w, s=sizes: grouped_matmul(x, w, s, "xla"), *f32)
        row = dict(routing=kind, op=op)
        for impl, out in outs.items():
            row[impl] = dict(err(out, ref), finite=bool(np.isfinite(np.asarray(out[0], np.float32)).all()))
        row["mgpu_vs_xla"] = err(outs[fast], outs["xla"])
        checks.append(row)
    ok = all(
        max(r[i][q] for q in ("y", "dx", "dw")) < 1e-2 and r[i]["finite"]
        for r in checks
        for i in ("xla", fast)
    )

    # speed at Qwen3-30B-A3B expert shapes: 16k tokens x top-8 rows, gate_up (2048 -> 1536) and down (768 -> 2048)
    speed = []
    rows_ = 2048 if smoke else 16384 * 8
    shapes = [("gate_up", 2048, 1536), ("down", 768, 2048)] if not smoke else [("gate_up", 128, 256)]
    for name, kk, nn in shapes:
        ge = 8 if smoke else 128
        sizes = jnp.asarray(_sizes("uniform", rows_, ge, rng))
        x = jnp.asarray(rng.standard_normal((rows_, kk)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((ge, kk, nn)) / np.sqrt(kk), jnp.bfloat16)
        dy = jnp.asarray(rng.standard_normal((rows_, nn)), jnp.bfloat16)
        flops = 2.0 * rows_ * kk * nn
        for impl in dict.fromkeys((fast, "xla") if smoke else (fast,)):
            fwd = jax.jit(lambda x, w, i=impl: grouped_matmul(x, w, sizes, i))  # noqa: B023
            _, vjp = jax.vjp(lambda x, w, i=impl: grouped_matmul(x, w, sizes, i), x, w)  # noqa: B023
            bwd = jax.jit(lambda dy, v=vjp: v(dy))
            try:
                _, tf = _timed(fwd, lambda: (x, w), 10, 2)  # noqa: B023
                _, tb = _timed(bwd, lambda: (dy,), 10, 2)  # noqa: B023
                speed.append(
                    dict(
                        shape=name,
                        impl=impl,
                        fwd_tflops=flops / tf / 1e12,
                        bwd_tflops=2 * flops / tb / 1e12,
                        fwd_ms=tf * 1e3,
                        bwd_ms=tb * 1e3,
                    )
                )
            except Exception as e:  # noqa: BLE001 - an OOM of the xla path is a result
                speed.append(dict(shape=name, impl=impl, error=repr(e)[:160]))
    return dict(checks=checks, ok=ok, speed=speed, impl=fast, device=str(jax.devices()[0].device_kind))


# ------------------------------------------------------------------------------------------------ step worker


def _model_config(c: dict):
    from primejax.models.config import ModelConfig

    tiny = c.get("tiny") or c["name"].startswith("tiny")
    model = c.get("model") or ("tiny" if tiny else "qwen3-30b-a3b")
    if tiny and not model.startswith("tiny"):
        model = {"glm": "tiny-glm", "dee": "tiny-deepseek"}.get(model[:3], "tiny")
    hf = dict(SHAPES[model], num_hidden_layers=c["layers"])
    return ModelConfig.from_hf_config(
        hf,
        **lora_options(c.get("lora", 0)),
        param_dtype=c["pdt"],
        compute_dtype="bfloat16",
        attention_impl=c["attn"],
        remat_policy=c["remat"],
        gmm_impl=c["gmm"],
        # "a2a:padded:1.5": expert_parallel a2a with that exchange and capacity factor
        # (models/moe_a2a.py); omitted parts take ModelConfig's defaults
        **_a2a_options(c["ep"]),
        scan_layers=bool(c.get("scan")),
        scan_unroll=c.get("unroll", 1),
        keep_gathered_experts=c.get("keep_gathered", False),
        keep_exchanged_tokens=c.get("keep_exchanged", False),
        deltanet_impl=c.get("deltanet", "auto"),
    )


def _a2a_options(ep: str) -> dict:
    mode, *rest = ep.split(":")
    keys = ("a2a_impl", "a2a_capacity_factor")
    kinds = (str, float)
    return dict(expert_parallel=mode, **{k: t(v) for k, t, v in zip(keys, kinds, rest, strict=False) if v})


def step_worker(c: dict) -> dict:
    """The trainer engine's RL step (trainer/engine.py, as `Trainer` builds it) on `devices` GPUs, timed."""
    import jax
    import numpy as np

    from primejax.trainer.config import MeshConfig, OptimConfig, TrainerConfig
    from primejax.trainer.engine import Engine
    from tools.bench_trainer import _fake_batch

    cfg = _model_config(c)
    rows, seq = c["rows"], c["seq"]
    micro = c.get("micro", 1)  # micro-batches per optimizer step (gradient accumulation)
    born = time.perf_counter()

    def progress(what: str) -> None:  # a row that times out reports the last of these
        print(f"PROGRESS {what} at {time.perf_counter() - born:.0f}s", file=sys.stderr, flush=True)

    context = c.get("context", 1)
    dp = c["devices"] // context
    t = TrainerConfig(
        mesh=MeshConfig(fsdp=-1, context=context),
        micro_batch_size=max(1, rows // dp),
        logprob_chunk_size=2048,
        optim=OptimConfig(
            offload=bool(c.get("offload")),
            offload_bucket_mb=c.get("bucket_mb", 1024.0),
            offload_master=c.get("offload_master", True),
            offload_inflight=c.get("inflight", 1),
            offload_resident_gib=c.get("resident_gib", 0.0),
        ),
    )
    engine = Engine.create(t, cfg, seed=0, devices=jax.devices()[: c["devices"]])
    jax.block_until_ready(engine.state)
    progress("state built")
    host = {
        k: np.asarray(v).reshape(micro, rows, seq)
        for k, v in _fake_batch(micro * rows, seq, cfg.vocab_size, "rl").items()
    }
    if c.get("replay"):
        host.update(_uniform_routing((micro, rows, seq), len(cfg.sparse_layers()), cfg))
    last = {}

    def on_step(metrics):
        last["load"] = metrics.get("moe/load")
        if c.get("offload"):
            metrics["loss"].block_until_ready()
            progress("step")

    res = time_engine_step(engine, host, "rl", 1, c, on_step=on_step, progress=progress)
    dt = res.pop("step_s")
    lora = {}
    if c.get("lora"):  # the adapters (experts' included) and their broadcast, as the trainer publishes it
        from tools.bench_trainer import _export_times

        lora = dict(adapter_params=sum(int(x.size) for x in jax.tree.leaves(engine.state.params)))
        lora.update(_export_times(engine, cfg, full=False))
    tokens = c.get("micro", 1) * rows * seq
    n_dev = c["devices"]
    # the softmax attention term of flops_per_token (Qwen3.5's DeltaNet layers have none)
    attn = 12 * len(cfg.full_attention_layers()) * cfg.num_heads * (cfg.hidden_size // cfg.num_heads) * seq
    flops = cfg.flops_per_token(seq)
    return dict(
        res,
        tok_s=tokens / dt,
        tok_s_gpu=tokens / dt / n_dev,
        step_ms=dt * 1e3,
        mfu=tokens * flops / dt / PEAK_FLOPS / n_dev,
        mfu_half_attn=tokens * (flops - attn / 2) / dt / PEAK_FLOPS / n_dev,
        active_params=cfg.num_matmul_params(),
        params=cfg.num_params(),
        device=str(jax.devices()[0].device_kind),
        # optimizer state per device by memory kind (offload: fp32 master + moments in pinned host memory)
        state_gib={
            kind: sum(x.nbytes for x in jax.tree.leaves(engine.state) if x.sharding.memory_kind == kind)
            / n_dev
            / 2**30
            for kind in {x.sharding.memory_kind for x in jax.tree.leaves(engine.state)}
        },
        buckets=len(engine.offload.plan.buckets) if engine.offload else 0,
        device_load=_device_load(last.get("load"), n_dev),
        **lora,
    )


def _uniform_routing(shape: tuple[int, ...], layers: int, cfg) -> dict:
    """Replayed routing (the batch's routed_experts, as rollouts bring them) that spreads every layer's pairs
    evenly over the experts: token t of layer l takes experts (b + j*s) mod E for j < k, b uniform, s odd (so
    the k are distinct when E is a power of two). Random init routes far from evenly per device (`device_load`);
    this is the balanced case to set beside it."""
    import numpy as np

    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if e & (e - 1):
        raise ValueError(f"uniform replayed routing needs a power-of-two expert count, got {e}")
    rng = np.random.default_rng(0)
    b = rng.integers(0, e, size=(*shape, layers, 1))
    s = 2 * rng.integers(0, e // 2, size=(*shape, layers, 1)) + 1
    experts = ((b + s * np.arange(k)) % e).astype(np.uint8)
    return {"routed_experts": experts, "routed_mask": np.ones(shape, bool)}


def _device_load(load, devices: int) -> dict | None:
    """Each sparse layer's expert load [Ls, E] summed per block of E / devices experts (the experts one device
    holds under expert parallelism), as a share of the balanced load: what each device's expert MLP runs in
    mode a2a, where every exchange waits for the device with the most."""
    if load is None:
        return None
    import numpy as np

    from primejax.trainer.moe_metrics import device_load_max

    top = device_load_max(load, devices)
    return dict(
        layer_max_mean=float(top.mean()), layer_max_max=float(top.max()), layer_max=np.round(top, 3).tolist()
    )


WORKERS = {
    "gmm": gmm_worker,
    "step": step_worker,
}


# ------------------------------------------------------------------------------------------------ driver


def _env(c: dict, smoke: bool) -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.95", PYTHONUNBUFFERED="1")
    if c.get("offload"):
        # The GPU client's pinned host memory is capped per device (docs/memory.md). Each device's host allocator
        # doubles its regions up to the cap: with 460 GB per device, 4 devices asked for 64 GiB regions on top of
        # 63 GiB each and the host refused (2026-11-27). The cap is each device's share of the 12 B/param + slack.
        from primejax.trainer.offload import host_state_bytes  # imports JAX, starts no backend
        from primejax.utils.devices import pinned_host_env

        state = host_state_bytes(
            _model_config(c).num_params(),
            c["devices"],
            master_on_host=c.get("offload_master", True),
            resident_gib=c.get("resident_gib", 0.0),
        )
        env.update(pinned_host_env(state, c["devices"], env))
    env.update(c.get("env") or {})
    flags = [env.get("XLA_FLAGS", ""), c.get("xla_flags", "")]
    if smoke:
        flags.append("--xla_force_host_platform_device_count=4")
        env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = " ".join(f for f in flags if f)
    return env


def _gmm_lines(r: dict) -> list[str]:
    if r.get("error"):
        return [f"gmm: FAIL {r['error'][-600:]}"]
    out = [f"grouped matmul ({r['impl']} vs xla, rel. error vs fp32; {r['device']}): ok={r['ok']}"]
    err = lambda v: f"y={v['y']:.1e} dx={v['dx']:.1e} dw={v['dw']:.1e}"  # noqa: E731
    for ch in r["checks"]:
        cells = "  ".join(f"{i}: {err(v)}" for i, v in ch.items() if isinstance(v, dict) and "finite" in v)
        out.append(f"  {ch['routing']:<8} {ch['op']:<6} {cells}  fast-vs-xla {err(ch['mgpu_vs_xla'])}")
    for s in r["speed"]:
        out.append(
            f"  {s['shape']:<8} {s['impl']:<5} "
            + (f"FAIL {s['error']}" if "error" in s else f"fwd {s['fwd_ms']:7.2f} ms {s['fwd_tflops']:6.0f} "
               f"TF/s   bwd {s['bwd_ms']:7.2f} ms {s['bwd_tflops']:6.0f} TF/s")
        )  # fmt: skip
    return out


def _table(results: list[dict]) -> str:
    out = [line for r in results if r["kind"] == "gmm" for line in _gmm_lines(r)]
    head = f"{'config':<26}{'gpus':>5}{'tok/s':>9}{'tok/s/gpu':>10}{'MFU':>7}{'MFU/2attn':>10}{'step ms':>9}{'peak GiB':>9}"
    out += [head, "-" * len(head)]
    for r in (r for r in results if r["kind"] == "step"):
        if not r.get("tok_s"):
            why = "OOM" if r.get("oom") else "FAIL"
            out.append(f"{r['name']:<26}{r['devices']:>5}  {why} {(r.get('error') or '')[-300:]}")
            continue
        notes = f"gmm={r['gmm']} remat={r['remat']} params={r['pdt']} scan={r['scan']} context={r['context']}"
        notes += f" compile={r['compile_s']:.0f}s"
        if r.get("adapter_export_s") is not None:
            notes += f" adapter={r['adapter_export_mb']:.0f}MB export={r['adapter_export_s']:.1f}s"
        if r.get("offload"):
            notes += f" offload: {r['buckets']} buckets, state GiB/gpu {r['state_gib']}"
        out.append(
            f"{r['name']:<26}{r['devices']:>5}{r['tok_s']:>9.0f}{r['tok_s_gpu']:>10.0f}{100 * r['mfu']:>6.1f}%"
            f"{100 * r['mfu_half_attn']:>9.1f}%{r['step_ms']:>9.0f}{r['peak_gib']:>9.1f}  {notes}"
        )
    return "\n".join(out)


if __name__ == "__main__":
    bench_main(__doc__, CONFIGS, WORKERS, _table, _env, script=__file__, suite="gpu1", timeout=240.0)
