"""The node-layout and multi-process rows of tools/bench_multigpu.py, and its table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tools.bench_multigpu_workers import _nvidia_smi

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


def run_layout(spec: dict, gpu_ids: list[int], args, job_cls) -> dict:
    """Stand-in server on the first GPU, the trainer on the second with the launcher's environment function."""
    import os

    from primejax.utils.devices import accelerator_env
    from tools.bench_multigpu import _env

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
        res = job_cls(dict(spec, scratch=args.scratch), [trainer], args, extra_env=extra).result()
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


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def run_multiproc(spec: dict, gpu_ids: list[int], args, job_cls, free_port) -> dict:
    """1 process x all GPUs, then 2 processes x half each (jax.distributed): same losses and exported weights."""
    import shutil

    root = Path(args.scratch) / "multiproc"
    shutil.rmtree(root, ignore_errors=True)
    half = len(gpu_ids) // 2
    one = job_cls(
        dict(spec, procs=1, pid=0, export_dir=str(root / "one"), name=spec["name"] + "-1x"), gpu_ids, args
    ).result()
    port = free_port()
    jobs = [
        job_cls(
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
