"""Qwen3-MoE on GPUs: grouped-matmul checks and speed, then the full RL trainer step, one table at the end.

    python tools/bench_moe.py                  # 1 GPU: 30B-A3B cut to 4, 8 and 10 layers at 16k
    python tools/bench_moe.py --suite gpu1:checks  # 1 GPU: the grouped matmul (mgpu) against XLA, then its speed
    python tools/bench_moe.py --suite gpu4     # 4 GPUs: 48-layer 30B-A3B, both expert-parallel modes
    python tools/bench_moe.py --suite gpu4:ep  # 4 GPUs: 48-layer 30B-A3B, expert parallelism by all-to-all vs fsdp
    python tools/bench_moe.py --suite gpu2:context  # 2 GPUs: a 32k row split over both (context parallelism)
    python tools/bench_moe.py --suite gpu1:families  # 1 GPU: GLM-4.5-Air cut to 4 layers next to Qwen3-30B-A3B
    python tools/bench_moe.py --suite gpu4:families  # 4 GPUs: GLM-4.5-Air cut to 8 layers, expert-parallel
    python tools/bench_moe.py --suite gpu1:qwen3_5  # 1 GPU: Qwen3.5-9B cut to 8 layers next to Qwen3-8B cut to 8
    python tools/bench_moe.py --suite gpu1:qwen3_5_moe  # 1 GPU: Qwen3.5-35B-A3B cut to 4 / 8 layers next to 30B-A3B
    python tools/bench_moe.py --smoke          # CPU, tiny shapes (proves the script before GPU time is spent)
    python tools/bench_moe.py --suite lora:gpu4   # 48-layer 30B-A3B LoRA (experts adapted) next to full FT

The suites' rows are in tools/bench_moe_suites.py. Each step configuration runs in its own process (an OOM stays
contained). The step is the trainer's own
(built and compiled by the trainer engine, primejax/trainer/engine.py), fake full rows of random tokens, RL loss
over every token. MFU: prime-rl's formula over active parameters (`ModelConfig.flops_per_token`: 6 x active
matmul params + 12 L H (D/H) T; GLM-4.5 uses its head width, 12 L H Dh T, and counts its shared expert as
active) at 989
TFLOP/s bf16 per GPU; `MFU/2attn` halves the attention term (causal).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench_moe_suites import CONFIGS, PEAK_FLOPS, SHAPES  # noqa: E402

# ------------------------------------------------------------------------------------------------ gmm worker


def _rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


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
    from tools.bench_trainer_profile import _timed

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

        def loss(x, w, impl):
            y = gmm(x, w, sizes, impl, all_rows_grouped=full)  # noqa: B023
            return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))  # noqa: B023

        outs = {}
        for impl in ("xla", fast):
            y = jax.jit(lambda x, w, i=impl: gmm(x, w, sizes, i, all_rows_grouped=full))(x, w)  # noqa: B023
            gx, gw = jax.jit(jax.grad(lambda x, w, i=impl: loss(x, w, i), argnums=(0, 1)))(x, w)
            outs[impl] = (y, gx, gw)
        # fp32 reference on upcast inputs
        ref = jax.jit(lambda x, w: grouped_matmul(x, w, sizes, "xla"))(  # noqa: B023
            x.astype(jnp.float32), w.astype(jnp.float32)
        )
        rgx, rgw = jax.jit(
            jax.grad(
                lambda x, w: jnp.sum(grouped_matmul(x, w, sizes, "xla") * dy.astype(jnp.float32)),  # noqa: B023
                argnums=(0, 1),
            )
        )(x.astype(jnp.float32), w.astype(jnp.float32))
        row = dict(routing=kind, op=op)
        for impl, (y, gx, gw) in outs.items():
            row[impl] = dict(
                y=_rel(y, ref),
                dx=_rel(gx, rgx),
                dw=_rel(gw, rgw),
                finite=bool(np.isfinite(np.asarray(y, np.float32)).all()),
            )
        row["mgpu_vs_xla"] = dict(
            y=_rel(outs[fast][0], outs["xla"][0]),
            dx=_rel(outs[fast][1], outs["xla"][1]),
            dw=_rel(outs[fast][2], outs["xla"][2]),
        )
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
    lora = {}
    if c.get("lora"):
        from primejax.models.lora import DEFAULT_TARGETS

        lora = dict(lora_rank=c["lora"], lora_alpha=2.0 * c["lora"], lora_targets=DEFAULT_TARGETS)
    return ModelConfig.from_hf_config(
        hf,
        **lora,
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
    from tools.bench_trainer_profile import _jax_peak_gib, _memory_analysis, _timed, _trace_summary

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
    batch = engine.device_batch(host)
    t0 = time.perf_counter()
    step = engine.lower(batch, "rl", 1).compile()
    compile_s = time.perf_counter() - t0
    progress("compiled")

    frozen = engine._frozen_arg()  # LoRA: the frozen weights are the step's third argument
    last = {}

    def run(b):
        engine.state, metrics = step(engine.state, b, *frozen)
        last["load"] = metrics.get("moe/load")
        loss = metrics["loss"]
        if c.get("offload"):
            loss.block_until_ready()
            progress("step")
        return loss

    with jax.set_mesh(engine.mesh):
        first, dt = _timed(run, lambda: (batch,), c["steps"], c["warmup"])
        loss = float(run(batch))
        trace = _trace_summary(run, batch, top=60) if c.get("trace") else None
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
        tok_s=tokens / dt,
        tok_s_gpu=tokens / dt / n_dev,
        step_ms=dt * 1e3,
        loss=loss,
        compile_s=compile_s,
        first_step_s=first,
        mfu=tokens * flops / dt / PEAK_FLOPS / n_dev,
        mfu_half_attn=tokens * (flops - attn / 2) / dt / PEAK_FLOPS / n_dev,
        peak_gib=_jax_peak_gib(),
        memory=_memory_analysis(step),
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
        trace=trace,
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


def _run_child(c: dict, timeout: float, smoke: bool) -> dict:
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
    if c.get("xla_flags"):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + c["xla_flags"]).strip()
    if smoke:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
        env["JAX_PLATFORMS"] = "cpu"
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(c)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as e:  # keep where it was: the worker's progress lines (stderr)
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        done = [ln for ln in err.splitlines() if ln.startswith("PROGRESS ")]
        return dict(
            c, error=f"timeout after {timeout:.0f}s" + (f"; last: {' | '.join(done[-4:])}" if done else "")
        )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        tail = (p.stderr or p.stdout)[-2000:]
        oom = "RESOURCE_EXHAUSTED" in tail or "out of memory" in tail.lower()
        # An OOM keeps its own line (how much was asked for, at compile or run time): the next fit starts there.
        why = [ln for ln in tail.splitlines() if "RESOURCE_EXHAUSTED" in ln or "out of memory" in ln.lower()]
        error = tail if not oom else "OOM: " + (why[0].strip()[:400] if why else "")
        return dict(c, oom=oom, error=error, wall_s=time.perf_counter() - t0)
    return dict(c, **json.loads(lines[-1][7:]), wall_s=time.perf_counter() - t0)


def _table(results: list[dict]) -> str:
    out = []
    for r in results:
        if r["kind"] != "gmm":
            continue
        if r.get("error"):
            out.append(f"gmm: FAIL {r['error'][-600:]}")
            continue
        out.append(f"grouped matmul ({r['impl']} vs xla, rel. error vs fp32; {r['device']}): ok={r['ok']}")
        for ch in r["checks"]:
            cells = "  ".join(
                f"{i}: y={v['y']:.1e} dx={v['dx']:.1e} dw={v['dw']:.1e}"
                for i, v in ch.items()
                if isinstance(v, dict) and "finite" in v
            )
            mv = ch["mgpu_vs_xla"]
            out.append(
                f"  {ch['routing']:<8} {ch.get('op', 'base'):<6} {cells}  fast-vs-xla y={mv['y']:.1e} dx={mv['dx']:.1e} dw={mv['dw']:.1e}"
            )
        for s in r["speed"]:
            if "error" in s:
                out.append(f"  {s['shape']:<8} {s['impl']:<5} FAIL {s['error']}")
            else:
                out.append(
                    f"  {s['shape']:<8} {s['impl']:<5} fwd {s['fwd_ms']:7.2f} ms {s['fwd_tflops']:6.0f} TF/s   "
                    f"bwd {s['bwd_ms']:7.2f} ms {s['bwd_tflops']:6.0f} TF/s"
                )
    head = f"{'config':<26}{'gpus':>5}{'tok/s':>9}{'tok/s/gpu':>10}{'MFU':>7}{'MFU/2attn':>10}{'step ms':>9}{'peak GiB':>9}"
    out += [head, "-" * len(head)]
    for r in results:
        if r["kind"] != "step":
            continue
        if r.get("tok_s"):
            out.append(
                f"{r['name']:<26}{r['devices']:>5}{r['tok_s']:>9.0f}{r['tok_s_gpu']:>10.0f}{100 * r['mfu']:>6.1f}%"
                f"{100 * r['mfu_half_attn']:>9.1f}%{r['step_ms']:>9.0f}{r['peak_gib']:>9.1f}"
                f"  gmm={r['gmm']} remat={r['remat']} params={r['pdt']} scan={r['scan']}"
                f" context={r.get('context', 1)} compile={r['compile_s']:.0f}s"
                + (
                    f" adapter={r['adapter_export_mb']:.0f}MB export={r['adapter_export_s']:.1f}s"
                    if r.get("adapter_export_s") is not None
                    else ""
                )
                + (
                    f" offload: {r['buckets']} buckets, state GiB/gpu {r['state_gib']}"
                    if r.get("offload")
                    else ""
                )
            )
        else:
            out.append(
                f"{r['name']:<26}{r['devices']:>5}  {'OOM' if r.get('oom') else 'FAIL'} "
                f"{(r.get('error') or '')[-300:]}"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="gpu1", choices=sorted(CONFIGS))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (= --suite smoke)")
    ap.add_argument("--only", default="", help="comma-separated row names, run in this order")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--budget", type=float, default=0.0, help="seconds for the whole suite (0 = none)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        c = json.loads(args.worker)
        print("RESULT " + json.dumps(WORKERS[c["kind"]](c)), flush=True)
        return
    suite = "smoke" if args.smoke and not args.suite.startswith("smoke") else args.suite
    configs = CONFIGS[suite]
    if args.only:
        by_name = {c["name"]: c for c in configs}  # in the order given: the budget goes to the first
        configs = [by_name[n] for n in args.only.split(",") if n in by_name]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, start = [], time.perf_counter()
    for c in configs:
        left = args.budget - (time.perf_counter() - start) if args.budget else args.timeout
        if left < 20:
            results.append(dict(c, error="skipped: suite budget spent"))
            continue
        if c.get("fallback") and any(r.get("tok_s") for r in results):
            continue
        if any(r["name"] == c.get("skip_if_oom") and r.get("oom") for r in results):
            results.append(dict(c, error="skipped: a config needing less memory ran out"))
            continue
        r = _run_child(c, min(args.timeout, left), args.smoke or suite.startswith("smoke"))
        results.append(r)
        print(json.dumps(r)[:3000], flush=True)
        (out / "bench_moe.jsonl").open("a").write(json.dumps(r) + "\n")
    print(_table(results))


if __name__ == "__main__":
    main()
