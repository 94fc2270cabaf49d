"""Multi-GPU trainer suite (issue 16): every row in one command on a 4-GPU machine, then one table.

    PYTHONUNBUFFERED=1 python3 tools/bench_multigpu.py --budget 530     # nvidia-h100-x4, ~9 min
    python tools/bench_multigpu.py --smoke                              # the same code on emulated CPU devices
    python tools/bench_multigpu.py --only weak:4b:1,node-layout         # some rows

Rows: Qwen3-4B / Qwen3-8B shapes (random init, fp32 master weights + AdamW, bf16 compute, the trainer's own
jitted RL step) at 16k and 64k tokens per GPU, FSDP over 4 GPUs (and FSDP x tensor for 4B at 16k); weak
scaling 1 -> 2 -> 4 GPUs for 4B at 16k; context parallelism (4B, one 128k and one 256k row over 4 GPUs);
Orbax save/restore and safetensors export of the trained 8B; the node layout (a stand-in server allocating on
GPU 0, the trainer given GPU 1 by the launcher's own environment function, nvidia-smi read while both hold
their memory); 2 processes x 2 GPUs with jax.distributed against 1 process x 4 GPUs (losses, exported weights).
The 1-GPU row of each model runs in the same suite: the full model where its fp32 state fits one card, else
the same layers at a reduced depth (named "@L<n>"; MFU is per its own FLOPs, so rows stay comparable).

Each row runs in its own process with only its GPUs visible (CUDA_VISIBLE_DEVICES), so an OOM stays contained
and rows of 1-2 GPUs run side by side on disjoint GPUs; a row may list fallbacks (a remat policy or depth that
fits) tried in order after an OOM. Results go to $OUT (or --out) as they arrive: results.json, table.txt.
The workers (this file with `--worker`) import nothing the GPU image lacks (ml_collections, tensorboardX, vllm,
verifiers); a row's step is the trainer engine's (primejax/trainer/engine.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.bench_trainer import _fake_batch  # noqa: E402
from tools.bench_trainer_profile import _memory_analysis  # noqa: E402
from tools.model_shapes import QWEN3  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
K = 1024
GIB = 2.0**30
PEAK_FLOPS = 989e12  # H100 / H200 SXM dense bf16, prime-rl's MFU denominator


def _train(name, model, gpus, seq, **kw):
    """A training row: `seq` tokens per row, `rows` rows per step (default one row per data-parallel GPU)."""
    row = dict(kind="train", name=name, model=model, gpus=gpus, seq=seq, layers=None, fsdp=-1, context=1)
    row.update(tensor=1, remat="attn", save_gib=0.0, steps=2, warmup=1, io=None, baseline=None, scan=False)
    row.update(dict(timeout=None, alts=()), **kw)
    row.setdefault("rows", max(1, gpus // (row["context"] * row["tensor"])))
    row["alts"] = list(row.get("alts", ()))
    return row


# Memory plan (80 GB H100; docs/scaling.md): fp32 params + AdamW moments + fp32 grads are 16 B/param, so
# 4B is 64 GB on one card (too close with activations: the 1-GPU rows fall back to 18 of its 36 layers) and
# 8B (8.2B with its untied head) never fits one card (8 of its layers do). On 4 cards the state is 16 / 33 GB
# per card; remat "attn" keeps per layer only the layer input and cuDNN's attention output (~13 kB per token
# for 4B, 16 kB for 8B), so 64k tokens per GPU holds ~31 / 39 GB of residuals: 4B fits, 8B is at the edge and
# falls back to "full" remat (layer inputs only, 8 kB per token). The head recomputes its logits (save_gib 0):
# keeping 15 GB of logits per 16k tokens would not fit next to the state.
ONE = dict(steps=1, warmup=0)  # rows of 64k+ tokens per GPU: one timed step, no warm-up
CP4 = dict(rows=1, fsdp=1, context=4, **ONE)  # one long row split over 4 GPUs
OFFLOAD_THEN_FULL = [dict(remat="attn_offload"), dict(remat="full")]
SUITE = [
    # 1-2 GPUs each, side by side on disjoint GPUs
    dict(_train("node-layout", "qwen3-0.6b", 2, 8 * K, rows=1, steps=3, layers=8), kind="layout"),
    _train("weak:4b:2", "qwen3-4b", 2, 16 * K, baseline="weak:4b:1"),
    _train("weak:4b:1", "qwen3-4b", 1, 16 * K, alts=[dict(layers=18, name="weak:4b@L18:1")]),
    _train("1gpu:8b@L8:16k", "qwen3-8b", 1, 16 * K, layers=8),
    _train("1gpu:4b@L18:64k", "qwen3-4b", 1, 64 * K, layers=18, **ONE),
    _train("1gpu:8b@L8:64k", "qwen3-8b", 1, 64 * K, layers=8, alts=[dict(remat="full")], **ONE),
    # all 4 GPUs, in order of priority (a --budget skips from the end)
    _train("weak:4b:4", "qwen3-4b", 4, 16 * K, baseline="weak:4b:1"),
    _train("8b:16k:fsdp4", "qwen3-8b", 4, 16 * K, baseline="1gpu:8b@L8:16k", io="params", timeout=420),
    _train(
        "cp:4b:128k", "qwen3-4b", 4, 128 * K, baseline="1gpu:4b@L18:64k", alts=OFFLOAD_THEN_FULL[:1], **CP4
    ),
    _train(
        "cp:4b:256k",
        "qwen3-4b",
        4,
        256 * K,
        baseline="1gpu:4b@L18:64k",
        alts=OFFLOAD_THEN_FULL,
        timeout=300,
        **CP4,
    ),
    _train("4b:64k:fsdp4", "qwen3-4b", 4, 64 * K, baseline="1gpu:4b@L18:64k", alts=OFFLOAD_THEN_FULL, **ONE),
    dict(
        kind="multiproc",
        name="2proc-vs-1proc",
        model="qwen3-0.6b",
        gpus=4,
        seq=4 * K,
        rows=8,
        layers=4,
        steps=3,
    ),
    _train(
        "8b:64k:fsdp4",
        "qwen3-8b",
        4,
        64 * K,
        remat="attn_offload",
        baseline="1gpu:8b@L8:64k",
        alts=OFFLOAD_THEN_FULL[1:],
        **ONE,
    ),
    _train("4b:16k:fsdp2-tensor2", "qwen3-4b", 4, 16 * K, rows=2, fsdp=2, tensor=2, baseline="weak:4b:1"),
]
SMOKE_SEQ = 64  # --smoke divides every length by this (16k -> 256 tokens) and runs tiny shapes on CPU


# ---- workers: one process each, only its GPUs visible

# Random-init shapes (tools/model_shapes.py), with positions up to the longest context-parallel row.
MODELS = {
    name: dict(QWEN3[name], max_position_embeddings=positions)
    for name, positions in (("qwen3-4b", 262144), ("qwen3-8b", 262144), ("qwen3-0.6b", 65536))
}
# --smoke: the same code on emulated CPU devices with these shapes (heads divisible by context * tensor).
SMOKE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
)


def model_config(c: dict):
    from primejax.models.config import ModelConfig

    hf = dict(MODELS[c["model"]])
    if c.get("smoke"):
        hf.update(SMOKE)
    if c.get("layers"):
        hf["num_hidden_layers"] = c["layers"]
    return ModelConfig.from_hf_config(
        hf,
        param_dtype="float32",
        compute_dtype="float32" if c.get("smoke") else "bfloat16",
        attention_impl=c.get("attn", "auto"),
        remat_policy=c.get("remat", "auto"),
        scan_layers=c.get("scan", False),
    )


def fake_rows(rows: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """[1, rows, seq] host arrays: bench_trainer's random rl rows (one sample per row), one micro-batch."""
    import numpy as np

    return {k: np.asarray(v)[None] for k, v in _fake_batch(rows, seq, vocab, "rl", seed).items()}


def peak_gib() -> float:
    """Highest peak of JAX's allocator over this process's devices (0 where the runtime keeps none: CPU)."""
    import jax

    return (
        max(((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices()), default=0)
        / GIB
    )


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _engine(c: dict, mesh: dict, lr: float = 1e-6, chunk: int = 2048):
    """The trainer engine (trainer/engine.py) for this configuration: what `Trainer` builds from the config."""
    from primejax.trainer.config import MeshConfig, OptimConfig, TrainerConfig
    from primejax.trainer.engine import Engine

    t = TrainerConfig(
        mesh=MeshConfig(**mesh),
        logprob_chunk_size=chunk,
        lm_head_saved_logits_gib=float(c.get("save_gib", -1.0)),
        optim=OptimConfig(lr=lr),
    )
    return Engine.create(t, model_config(c), seed=0)


def _build(c: dict):
    """(engine, compiled step, device batch, compile seconds, XLA memory)."""
    mesh = dict(data=1, fsdp=c.get("fsdp", -1), context=c.get("context", 1), tensor=c.get("tensor", 1))
    engine = _engine(c, mesh, chunk=c.get("chunk", 2048))
    batch = engine.device_batch(fake_rows(c["rows"], c["seq"], engine.model_cfg.vocab_size))
    t0 = time.perf_counter()
    compiled = engine.lower(engine.abstract_batch(1, c["rows"], c["seq"]), "rl", 1).compile()
    return engine, compiled, batch, time.perf_counter() - t0, _memory_analysis(compiled)


def _steps(compiled, state, batch, warmup: int, steps: int):
    """(state, seconds per timed step, losses): warm-up steps, then `steps` dispatched back to back."""
    import jax

    losses = []
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics["loss"])
    dt = (time.perf_counter() - t0) / steps
    losses.append(float(metrics["loss"]))
    return state, dt, losses


def train_worker(c: dict, emit) -> dict:
    import jax

    engine, compiled, batch, compile_s, mem = _build(c)
    mesh, cfg = engine.mesh, engine.model_cfg
    with jax.set_mesh(mesh):
        engine.state, dt, losses = _steps(
            compiled, engine.state, batch, c.get("warmup", 1), c.get("steps", 2)
        )
    n = jax.device_count()
    tokens = c["rows"] * c["seq"]
    res = dict(
        devices=n,
        mesh={k: int(v) for k, v in mesh.shape.items()},
        tok_s=tokens / dt,
        tok_s_gpu=tokens / dt / n,
        step_s=dt,
        compile_s=compile_s,
        loss=losses[-1],
        mfu=tokens * cfg.flops_per_token(c["seq"]) / dt / (PEAK_FLOPS * n),
        peak_gib=peak_gib(),
        memory=mem,
        params_b=cfg.num_params() / 1e9,
        layers=cfg.num_layers,
        platform=jax.devices()[0].platform,
        device_kind=jax.devices()[0].device_kind,
    )
    if c.get("io"):
        emit(res)  # the step's figures survive a timeout in the (slower) checkpoint and export below
        res.update(_io(c, engine))
    return res


def _io(c: dict, engine) -> dict:
    """Orbax save + restore of the trained state (or its parameters) and a bf16 safetensors export, timed."""
    import jax
    import numpy as np

    from primejax.contracts.rundir import RunDir
    from primejax.models.hf_io import export_safetensors
    from primejax.trainer.checkpoint import TrainerCheckpointer

    root = Path(c["scratch"]) / c["name"].replace(":", "_")
    shutil.rmtree(root, ignore_errors=True)
    state = engine.state
    what = state if c["io"] == "state" else state.params
    ckpt = TrainerCheckpointer(root / "run", keep=1, async_save=False)
    out: dict = {"io_what": c["io"]}
    try:
        jax.block_until_ready(what)
        t0 = time.perf_counter()
        ckpt.save(1, what, {"bench": True})
        out["ckpt_save_s"] = time.perf_counter() - t0
        nbytes = _dir_bytes(RunDir(root / "run").checkpoints())
        out["ckpt_gb"] = nbytes / 1e9
        out["ckpt_save_gb_s"] = nbytes / 1e9 / out["ckpt_save_s"]
        t0 = time.perf_counter()
        restored, _ = ckpt.restore(1, what)
        jax.block_until_ready(restored)
        out["ckpt_restore_s"] = time.perf_counter() - t0
        out["ckpt_restore_gb_s"] = nbytes / 1e9 / out["ckpt_restore_s"]
        a, b = jax.tree.leaves(what)[0], jax.tree.leaves(restored)[0]
        out["ckpt_restore_equal"] = bool(
            np.array_equal(np.asarray(a.addressable_shards[0].data), np.asarray(b.addressable_shards[0].data))
        )
        out["ckpt_restore_sharding_kept"] = b.sharding == a.sharding
        del restored
    finally:
        ckpt.close()
    with jax.set_mesh(engine.mesh):
        t0 = time.perf_counter()
        info = export_safetensors(engine.model(), engine.model_cfg, root / "export", dtype="bfloat16")
    out["export_s"] = time.perf_counter() - t0
    out["export_gb"] = info["bytes"] / 1e9
    out["export_gb_s"] = info["bytes"] / 1e9 / out["export_s"]
    out["export_files"] = info["files"]
    shutil.rmtree(root, ignore_errors=True)
    return out


def _nvidia_smi() -> dict:
    """Per-GPU memory used (MiB) and the compute processes nvidia-smi lists, or why it could not say."""
    try:
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": repr(e)[:200]}
    by_uuid = {}
    out = {"gpus": {}, "apps": []}
    for line in gpus.strip().splitlines():
        idx, uuid, used = (x.strip() for x in line.split(","))
        by_uuid[uuid] = int(idx)
        out["gpus"][idx] = int(used)
    for line in apps.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[1] in by_uuid:
            out["apps"].append({"pid": int(parts[0]), "gpu": by_uuid[parts[1]], "mib": parts[2]})
    return out


def layout_worker(c: dict, emit) -> dict:
    """The node layout's trainer (started by the driver with accelerator_env(trainer.devices)): steps, then
    nvidia-smi while this process still holds its arrays."""
    import jax

    res = train_worker(dict(c, io=None), emit)
    res["visible_devices"] = [str(d) for d in jax.devices()]
    res["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    res["mem_fraction"] = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    res["jax_bytes_in_use"] = [(d.memory_stats() or {}).get("bytes_in_use", 0) for d in jax.local_devices()]
    res["smi_while_training"] = _nvidia_smi()
    res["pid"] = os.getpid()
    return res


def multiproc_worker(c: dict, emit) -> dict:
    """One of `c['procs']` processes: global rows from a fixed seed, this process's share placed as its part of
    the [M, R, T] batch; `c['steps']` steps; process 0 exports fp32 safetensors (the others join the gathers)."""
    import jax

    if c["procs"] > 1:
        if c.get("smoke"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(c["coordinator"], num_processes=c["procs"], process_id=c["pid"])
    from primejax.models.hf_io import export_safetensors

    engine = _engine(c, dict(fsdp=-1), lr=1e-4, chunk=1024)
    whole = fake_rows(c["rows"], c["seq"], engine.model_cfg.vocab_size, seed=7)
    share = c["rows"] // c["procs"]
    mine = {k: v[:, c["pid"] * share : (c["pid"] + 1) * share] for k, v in whole.items()}
    losses = []
    batch = engine.device_batch(mine)
    for _ in range(c["steps"]):
        losses.append(float(engine.run(batch, "rl", 1)["loss"]))
    with jax.set_mesh(engine.mesh):
        # Each process writes its share of the files (as the trainer's multi-host export does).
        info = export_safetensors(
            engine.model(),
            engine.model_cfg,
            Path(c["export_dir"]),
            dtype="float32",
            max_shard_bytes=2**12 if c.get("smoke") else 2**26,  # several files: both processes write
            writer=(jax.process_index(), jax.process_count()),
        )
    return dict(
        losses=losses,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        devices=jax.device_count(),
        local_devices=jax.local_device_count(),
        export_bytes_written=info["bytes_written"],
        export_bytes=info["bytes"],
    )


WORKERS = {"train": train_worker, "layout": layout_worker, "multiproc": multiproc_worker}


def worker_main(spec: str) -> None:
    c = json.loads(spec)

    def emit(res: dict) -> None:
        print("PARTIAL " + json.dumps(res), flush=True)

    print("RESULT " + json.dumps(WORKERS[c["kind"]](c, emit)), flush=True)


# ---- the node-layout and multi-process rows, the table

# A stand-in inference server: holds STANDIN_GIB on its GPU (preallocation off, so nvidia-smi shows just that)
# until its stdin closes.
STANDIN_GIB = 4
_STANDIN = f"""
import sys, jax, jax.numpy as jnp
x = jnp.ones(({STANDIN_GIB} * 2**28,), jnp.float32).block_until_ready()
print("READY", jax.devices(), flush=True)
sys.stdin.read()
"""
# A CUDA context alone takes ~0.5 GiB: anything the trainer created on the server's GPU would show this much.
LAYOUT_TOLERANCE_MIB = 64


def run_layout(spec: dict, gpu_ids: list[int], args) -> dict:
    """Stand-in server on the first GPU, the trainer on the second with the launcher's environment function."""
    from primejax.utils.devices import accelerator_env

    server, trainer = gpu_ids[0], gpu_ids[-1]
    before = _nvidia_smi()
    env = _env(
        [server], args.smoke, dict(accelerator_env(str(server)), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    )
    if not args.smoke:
        env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    standin = subprocess.Popen(
        [sys.executable, "-c", _STANDIN], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        ready = standin.stdout.readline()
        if not ready.startswith("READY"):
            return dict(spec, error=f"stand-in server did not start: {ready!r}")
        with_server = _nvidia_smi()
        # What `primejax.launcher` gives the trainer for trainer.devices=<trainer>, memory_fraction=0.5.
        extra = accelerator_env(str(trainer), 0.5) if not args.smoke else {}
        res = Job(dict(spec, scratch=args.scratch), [trainer], args, extra_env=extra).result()
    finally:
        standin.stdin.close()
        standin.wait(timeout=60)
    res.update(
        server_gpu=server,
        trainer_gpu=trainer,
        smi_before=before,
        smi_with_server=with_server,
        standin_pid=standin.pid,
        launcher_env=extra,
        host_pid=os.getpid(),
    )
    during = res.get("smi_while_training", {})
    if "gpus" in with_server and "gpus" in during:
        s, t = str(server), str(trainer)
        res["server_gpu_delta_mib"] = during["gpus"][s] - with_server["gpus"][s]
        res["trainer_gpu_delta_mib"] = during["gpus"][t] - with_server["gpus"][t]
        res["trainer_pid_on_server_gpu"] = any(
            a["pid"] == res.get("pid") and a["gpu"] == server for a in during.get("apps", [])
        )
        res["layout_ok"] = (
            abs(res["server_gpu_delta_mib"]) <= LAYOUT_TOLERANCE_MIB
            and res["trainer_gpu_delta_mib"] > 1024
            and not res["trainer_pid_on_server_gpu"]
            and len(res.get("visible_devices", [])) == 1
        )
    else:  # no nvidia-smi (CPU smoke): what can be checked is that the trainer saw one device
        res["layout_ok"] = len(res.get("visible_devices", [])) == 1 and "tok_s" in res
        res["note"] = "nvidia-smi unavailable: device count only"
    return res


def _tensors(directory: Path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def run_multiproc(spec: dict, gpu_ids: list[int], args) -> dict:
    """1 process x all GPUs, then 2 processes x half each (jax.distributed): same losses and exported weights."""
    import numpy as np

    root = Path(args.scratch) / "multiproc"
    shutil.rmtree(root, ignore_errors=True)
    half = len(gpu_ids) // 2
    one = Job(
        dict(spec, procs=1, pid=0, export_dir=str(root / "one"), name=spec["name"] + "-1x"), gpu_ids, args
    ).result()
    port = _free_port()
    jobs = [
        Job(
            dict(
                spec,
                procs=2,
                pid=p,
                coordinator=f"127.0.0.1:{port}",
                export_dir=str(root / "two"),
                name=f"{spec['name']}-2x-p{p}",
            ),
            gpu_ids[p * half : (p + 1) * half],
            args,
        )
        for p in range(2)
    ]
    two = [j.result() for j in jobs]
    res = dict(spec, one=one, two=two)
    if "losses" not in one or any("losses" not in t for t in two):
        res["error"] = (
            "a run failed: " + json.dumps([one.get("error"), *[t.get("error") for t in two]])[:3000]
        )
        return res
    l1, l2 = np.array(one["losses"]), np.array(two[0]["losses"])
    a, b = _tensors(root / "one"), _tensors(root / "two")
    res["loss_max_rel_diff"] = float(np.max(np.abs(l2 - l1) / np.abs(l1)))
    res["weights_same_names"] = sorted(a) == sorted(b)
    res["weights_max_abs_diff"] = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    res["weights_max_rel_norm"] = max(
        float(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(a[k]), 1e-12)) for k in a
    )
    res["processes"] = [t["process_count"] for t in two]
    res["export_bytes_written"] = [t["export_bytes_written"] for t in two]  # each process its share of files
    res["multiproc_ok"] = bool(
        res["loss_max_rel_diff"] < 1e-4
        and res["weights_same_names"]
        and res["weights_max_rel_norm"] < 1e-4
        and res["processes"] == [2, 2]
        and min(res["export_bytes_written"]) > 0
    )
    shutil.rmtree(root, ignore_errors=True)
    return res


def table(rows: list[dict]) -> str:
    by_key = {r.get("tried") or r["name"]: r for r in rows}
    head = (
        f"{'row':<26}{'GPUs':>5} {'mesh':<18}{'tok/GPU':>8}{'tok/s':>9}{'tok/s/GPU':>10}{'MFU':>7}"
        f"{'peak GiB':>9}{'step s':>8}{'comp s':>7}  1-GPU row of the model (tok/s/GPU, MFU) -> efficiency"
    )
    lines = [head, "-" * len(head)]
    extra = []
    for r in rows:
        if r["kind"] == "train" or r["kind"] == "layout":
            mesh = r.get("mesh") or {}
            m = "x".join(f"{k[0]}{v}" for k, v in mesh.items() if v > 1 and k != "data") or "-"
            tok_gpu = r["seq"] * r["rows"] // max(r["gpus"], 1)
            if r.get("tok_s"):
                base = by_key.get(r.get("baseline") or "")
                ref = ""
                if base and base.get("mfu") and base is not r:
                    ref = (
                        f"{base['name']}: {base['tok_s_gpu']:,.0f}, {100 * base['mfu']:.1f}% -> "
                        f"{r['mfu'] / base['mfu']:.0%}"
                    )
                note = f"remat={r.get('remat')} L={r.get('layers')}" + (
                    " (fallback)" if r.get("tried") else ""
                )
                lines.append(
                    f"{r['name']:<26}{r['gpus']:>5} {m:<18}{tok_gpu:>8}{r['tok_s']:>9,.0f}"
                    f"{r['tok_s_gpu']:>10,.0f}{100 * r['mfu']:>6.1f}%{r['peak_gib']:>9.1f}"
                    f"{r['step_s']:>8.2f}{r['compile_s']:>7.0f}  {ref}  [{note}]"
                )
            else:
                status = "OOM" if r.get("oom") else ("SKIP" if "skipped" in str(r.get("error")) else "FAIL")
                lines.append(f"{r['name']:<26}{r['gpus']:>5} {'':<18}{tok_gpu:>8}{status:>9}")
        for failed in r.get("failed_attempts", []):
            extra.append(f"{r['name']}: tried first {failed}"[:500])
        if r.get("ckpt_save_s"):
            extra.append(
                f"{r['name']}: Orbax {r['io_what']} {r['ckpt_gb']:.1f} GB save {r['ckpt_save_s']:.1f} s "
                f"({r['ckpt_save_gb_s']:.2f} GB/s), restore {r['ckpt_restore_s']:.1f} s "
                f"({r['ckpt_restore_gb_s']:.2f} GB/s, equal={r['ckpt_restore_equal']}, "
                f"sharding kept={r['ckpt_restore_sharding_kept']}); safetensors bf16 export "
                f"{r['export_gb']:.1f} GB in {r['export_s']:.1f} s ({r['export_gb_s']:.2f} GB/s, "
                f"{r['export_files']} files)"
            )
        if r["kind"] == "layout":
            extra.append(
                f"node layout: ok={r.get('layout_ok')} server GPU {r.get('server_gpu')} delta while the "
                f"trainer ran {r.get('server_gpu_delta_mib')} MiB, trainer GPU {r.get('trainer_gpu')} "
                f"+{r.get('trainer_gpu_delta_mib')} MiB, trainer saw {r.get('visible_devices')} "
                f"{r.get('note', '')}"
            )
        elif r["kind"] == "multiproc":
            extra.append(
                f"2 processes x 2 GPUs vs 1 x 4: ok={r.get('multiproc_ok')} loss max rel diff "
                f"{r.get('loss_max_rel_diff')} weights max abs diff {r.get('weights_max_abs_diff')} "
                f"rel-norm {r.get('weights_max_rel_norm')} export bytes per process {r.get('export_bytes_written')} "
                f"{r.get('error') or ''}"
            )
    return "\n".join(lines + [""] + extra)


# ---- the driver


def _env(gpu_ids: list[int], smoke: bool, extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if smoke:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={len(gpu_ids)}")
    else:
        env.update(CUDA_VISIBLE_DEVICES=",".join(map(str, gpu_ids)), XLA_PYTHON_CLIENT_MEM_FRACTION="0.94")
    env.update(extra or {})
    return env


def _parse(stdout: str) -> dict | None:
    for tag in ("RESULT ", "PARTIAL "):
        lines = [ln for ln in stdout.splitlines() if ln.startswith(tag)]
        if lines:
            return dict(json.loads(lines[-1][len(tag) :]), **({} if tag == "RESULT " else {"partial": True}))
    return None


class Job:
    """One child process of a row on its GPUs (a row with fallbacks may start several, one after another)."""

    def __init__(self, spec: dict, gpu_ids: list[int], args, extra_env: dict | None = None, argv=None):
        self.spec, self.gpu_ids, self.t0 = spec, gpu_ids, time.perf_counter()
        self.timeout = spec.get("timeout") or args.timeout
        if args.budget:  # never past the suite's budget: what finished is written, the rest reported as cut
            self.timeout = max(10.0, min(self.timeout, args.budget - (self.t0 - args.start)))
        cmd = argv or [sys.executable, __file__, "--worker", json.dumps(spec)]
        self.log = open(Path(args.out) / f"log_{spec['name'].replace(':', '_')}.txt", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=_env(gpu_ids, args.smoke, extra_env),
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def result(self) -> dict:
        try:
            out, _ = self.proc.communicate(timeout=max(1.0, self.timeout - (time.perf_counter() - self.t0)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            res = _parse(out) or {}
            return dict(self.spec, **res, error=f"timeout after {self.timeout:.0f}s", wall_s=self._wall())
        self.log.close()
        res = _parse(out)
        if self.proc.returncode or res is None or res.get("partial"):
            tail = Path(self.log.name).read_text()[-2000:]
            oom = "RESOURCE_EXHAUSTED" in tail or "out of memory" in tail.lower()
            return dict(self.spec, **(res or {}), oom=oom, error=None if oom else tail, wall_s=self._wall())
        return dict(self.spec, **res, wall_s=self._wall())

    def _wall(self) -> float:
        return time.perf_counter() - self.t0


def _smoke(spec: dict) -> dict:
    s = dict(spec, smoke=True, seq=max(64, spec["seq"] // SMOKE_SEQ), steps=min(spec.get("steps", 2), 2))
    s["alts"] = [
        dict(a, layers=min(a["layers"], 2)) if a.get("layers") else dict(a) for a in spec.get("alts", [])
    ]
    if s.get("layers"):
        s["layers"] = min(s["layers"], 2)  # the code path, not the depth, is what a smoke run proves
    return s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_row(spec: dict, gpu_ids: list[int], args) -> dict:
    """Run one row to its end (fallbacks included); the node-layout and multi-process rows have their own."""
    if spec["kind"] == "layout":
        return run_layout(spec, gpu_ids, args)
    if spec["kind"] == "multiproc":
        return run_multiproc(spec, gpu_ids, args)
    tries = [spec] + [dict(spec, **alt, alts=[], tried=spec["name"]) for alt in spec.get("alts", [])]
    res: dict = {}
    failed: list[str] = []
    for attempt in tries:
        attempt = dict(attempt, scratch=args.scratch)
        res = Job(attempt, gpu_ids, args).result()
        # The next fallback after an OOM or a failure (an offload policy the compiler refuses); not after a
        # timeout: the budget is spent.
        if "tok_s" in res or "timeout" in str(res.get("error")):
            break
        what = "OOM" if res.get("oom") else "error: " + str(res.get("error"))[-300:]
        failed.append(
            f"{attempt['name']} remat={attempt.get('remat')} layers={attempt.get('layers')}: {what}"
        )
    return dict(res, failed_attempts=failed) if failed else res


def _schedule(suite: list[dict], args) -> list[dict]:
    """Rows in order; a row starts when enough GPUs are free (no overtaking), side by side with running ones."""
    import concurrent.futures as cf

    free = list(range(args.gpus))
    results: dict[str, dict] = {}
    running: dict[cf.Future, tuple[dict, list[int]]] = {}
    start = args.start
    with cf.ThreadPoolExecutor(max_workers=args.gpus) as pool:
        for spec in suite:
            if spec["gpus"] > args.gpus:
                results[spec["name"]] = dict(spec, error=f"needs {spec['gpus']} GPUs, have {args.gpus}")
                continue
            while len(free) < spec["gpus"]:
                done, _ = cf.wait(list(running), return_when=cf.FIRST_COMPLETED)
                for f in done:
                    s, ids = running.pop(f)
                    free += ids
                    results[s["name"]] = f.result()
                    _write(args, suite, results)
            if args.budget and time.perf_counter() - start > args.budget - 20:
                results[spec["name"]] = dict(spec, error="skipped: suite budget spent")
                continue
            ids, free = sorted(free)[: spec["gpus"]], sorted(free)[spec["gpus"] :]
            running[pool.submit(_run_row, spec, ids, args)] = (spec, ids)
        for f in cf.as_completed(list(running)):
            s, _ = running[f]
            results[s["name"]] = f.result()
            _write(args, suite, results)
    _write(args, suite, results)
    return [results[s["name"]] for s in suite if s["name"] in results]


def _write(args, suite: list[dict], results: dict[str, dict]) -> None:
    rows = [results[s["name"]] for s in suite if s["name"] in results]
    out = Path(args.out)
    (out / "results.json.tmp").write_text(json.dumps(rows, indent=1, default=str))
    os.replace(out / "results.json.tmp", out / "results.json")
    (out / "table.txt").write_text(table(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes on emulated CPU devices (proves the suite)"
    )
    ap.add_argument("--only", default="", help="comma-separated row names")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_multigpu_out"))
    ap.add_argument(
        "--scratch", default="/tmp/bench_multigpu", help="where checkpoints and exports are written"
    )
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per process")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds for the suite: later rows are skipped")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args.worker)
        return
    suite = [_smoke(s) for s in SUITE] if args.smoke else list(SUITE)
    if args.only:
        wanted = set(args.only.split(","))
        suite = [s for s in suite if s["name"] in wanted]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    t0 = args.start = time.perf_counter()
    results = _schedule(suite, args)
    print(table(results))
    print(f"\nsuite wall clock {time.perf_counter() - t0:.0f} s; results in {args.out}/results.json")


if __name__ == "__main__":
    main()
