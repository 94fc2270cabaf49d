"""Workers of tools/bench_multigpu.py, each run in its own process (see that file for the suite).

- `train_worker`: the trainer engine's RL step (primejax/trainer/engine.py) on a mesh of the visible devices,
  fake rows, timed; then optionally an Orbax save/restore and a safetensors export of the trained state.
- `layout_worker`: the node-layout check's trainer: sees only the GPU the launcher's own environment function
  gives it, runs steps, then reads nvidia-smi while it still holds its memory.
- `multiproc_worker`: one process of an N-process jax.distributed run (or the 1-process reference): a few
  steps on fixed rows, losses and an fp32 safetensors export for the driver to compare.

Nothing here imports ml_collections / tensorboardX / vllm / verifiers (absent from the GPU image).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from tools.model_shapes import QWEN3

GIB = 2.0**30
PEAK_FLOPS = 989e12  # H100 / H200 SXM dense bf16, prime-rl's MFU denominator

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
    """[1, rows, seq] host arrays of the step's fields: full rows of random tokens, one sample each, rl loss."""
    import numpy as np

    from primejax.contracts.batch import FIELDS

    rng = np.random.default_rng(seed)
    out = {k: np.zeros((1, rows, seq), dt) for k, dt in FIELDS.items()}
    out["tokens"][:] = rng.integers(0, vocab, (1, rows, seq))
    out["positions"][:] = np.arange(seq)
    out["segment_ids"][:] = 1
    out["loss_mask"][..., 1:] = True
    out["inference_logprobs"][..., 1:] = -rng.uniform(0.05, 5.0, (1, rows, seq - 1))
    out["advantages"][:] = rng.standard_normal((1, rows, 1))
    out["temperatures"][:] = 1.0
    out["rl_weights"][:] = 1.0
    return out


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
    compile_s = time.perf_counter() - t0
    try:
        m = compiled.memory_analysis()
        mem = {
            n: round(getattr(m, f"{n}_size_in_bytes") / GIB, 2)
            for n in ("argument", "output", "alias", "temp")
        }
    except Exception as e:  # noqa: BLE001 - informational only
        mem = {"error": repr(e)[:200]}
    return engine, compiled, batch, compile_s, mem


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


def main(spec: str) -> None:
    c = json.loads(spec)

    def emit(res: dict) -> None:
        print("PARTIAL " + json.dumps(res), flush=True)

    print("RESULT " + json.dumps(WORKERS[c["kind"]](c, emit)), flush=True)
