"""Weight transfer from a multi-process trainer (run through tools/bench_transfer.py; docs/weight_transfer.md), and
the helpers of every tools/bench_transfer.py row (shapes, the row's processes, the offer wait).

Two benchmarks with the trainer's own publisher (primejax.transports.weights.publish), model shapes of tools/model_shapes.py
at random init (bf16):

- `--senders 1,2 --receivers 2`: seconds per collective update from S trainer processes (jax.distributed, one
  GPU each: GPUs 0..S-1) to R stand-in receivers (GPUs 2, 3): the workers of one tensor-parallel (TP = R)
  server, each running `primejax.transports.weights.collective.wire.Receiver` (the code of primejax's vLLM engine) and keeping its
  own TP slice of every tensor (column-parallel rows, row-parallel columns, as vLLM's loaders narrow), copied
  into preallocated buffers. S = 1 is today's one-sender path (the whole model converted and sent from one
  GPU); S = 2 sends each process's row blocks over its own lane.
- `--export --processes P`: the filesystem export, GB/s, gather (each tensor all-gathered to the host, whole
  files) vs parallel (each process pwrites its own row blocks), P processes with one GPU each, into `--tmp`.

    NCCL_NVLS_ENABLE=0 python tools/bench_transfer.py --senders 1,2 --receivers 2 --shapes qwen3-8b,qwen3-30b-a3b \
        --paths old,new        # old: per tensor (before issue 47); new: stacks, receivers copy a stack at once
    python tools/bench_transfer.py --export --processes 4 --shapes qwen3-8b --tmp /path/on/local/disk
    python tools/bench_transfer.py --senders 1,2 --receivers 2 --smoke      # CPU, gloo, tiny shapes
    python tools/bench_transfer.py --export --processes 1,2 --cpu --shapes qwen3-0.6b   # CPU, real shapes

Per row: one warm-up round, then `--rounds` timed rounds of process 0's `publish`; the median is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.model_shapes import QWEN3, tiny

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def model_config(name: str, smoke: bool, **overrides):
    """The ModelConfig of Qwen3 checkpoint `name` (tools/model_shapes.py; `tiny` with --smoke), bf16."""
    from primejax.models.config import ModelConfig

    hf = tiny(QWEN3[name]) if smoke else QWEN3[name]
    return ModelConfig.from_hf_config(hf, param_dtype="bfloat16", **overrides)


def wait_file(path: Path, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout_s:.0f} s")
        time.sleep(0.001)
    return json.loads(path.read_text())


def write(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.rename(path)


def offers(run: Path, rounds: int):
    """The sender's offers of rounds 0..rounds-1, each as soon as it is written."""
    from primejax.transports.weights.collective.offer import latest_offer

    for r in range(rounds):
        deadline = time.monotonic() + 900
        while (offer := latest_offer(run)) is None or offer.step != r:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no offer for round {r}")
            time.sleep(0.0005)
        yield offer


def launch(a: argparse.Namespace, run: str, roles: list[list[str]]) -> dict:
    """One process per role: this script with the driver's own flags, `--run-dir` and the role's flags. The first
    prints `RESULT {json}` (returned); a hung row's processes print their stacks (SIGABRT) before it raises."""
    from primejax.inference.admin_auth import TOKEN_ENV, process_token

    here = Path(__file__).resolve().parent
    env = {
        **os.environ,
        TOKEN_ENV: process_token(),  # one run secret for all (each would otherwise refuse the others' store)
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "PYTHONFAULTHANDLER": "1",
        "PYTHONPATH": os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]),
    }
    if a.smoke or a.cpu:
        env["JAX_PLATFORMS"] = "cpu"
    # On GPUs every process sees every GPU (as vLLM's workers do), so NCCL can use peer access (NVLink).
    cmd = [sys.executable, str(here / "bench_transfer.py"), *sys.argv[1:], "--run-dir", run]
    procs = [
        subprocess.Popen(cmd + role, env=env, stdout=subprocess.PIPE if not i else None, text=True)
        for i, role in enumerate(roles)
    ]
    try:
        try:
            out, _ = procs[0].communicate(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(f"no result in {a.timeout:g} s; stacks of {[p.pid for p in procs if p.poll() is None]}:")
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGABRT)
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            raise
        for p in procs[1:]:
            p.wait(timeout=300)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{roles[0]}: a process failed ({[p.returncode for p in procs]})")
        result = [x for x in out.splitlines() if x.startswith("RESULT ")]
        return json.loads(result[-1].removeprefix("RESULT "))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def collective_sender(args: argparse.Namespace, device=None):
    """The trainer's sender into --run-dir: NCCL from `device` (a torch GPU), else gloo from host memory."""
    from primejax.inference.admin_auth import process_token
    from primejax.transports.weights.collective.sender import CollectiveSender

    backend, bucket_bytes = "nccl" if device else "gloo", args.bucket_mb * 2**20
    return CollectiveSender(
        Path(args.run_dir),
        secret=process_token(),
        timeout_s=600,
        bucket_bytes=bucket_bytes,
        backend=backend,
        device=device,
    )


def sender(a: argparse.Namespace) -> None:
    import jax

    gpu = not (a.smoke or a.cpu)
    if a.nproc > 1 or gpu:
        kw = {"local_device_ids": [a.pid]} if gpu else {}
        jax.distributed.initialize(a.coordinator, a.nproc, a.pid, **kw)
    from primejax.models.sharding import make_mesh
    from primejax.models.transformer import init_model
    from primejax.trainer.config import BroadcastConfig
    from primejax.transports.weights.publish import FilesystemPublisher, make_publisher

    cfg = model_config(a.shape, a.smoke)
    model = init_model(cfg, make_mesh(fsdp=-1), seed=0)
    jax.block_until_ready(jax.tree.leaves(model))
    run = Path(a.run_dir)
    rows = {}
    if a.export:
        import functools

        from primejax.transports.weights.filesystem import export as fs_export

        parallel_export = fs_export.export_parallel
        for mode in a.export_modes.split(","):
            # "parallel-pwrite": the parallel export's locked pwrite writer (fs_export's docstring), the one before
            # the mmap writer; the same publisher, its export function bound to writer="pwrite"
            fs_export.export_parallel = (
                functools.partial(parallel_export, writer="pwrite")
                if mode == "parallel-pwrite"
                else parallel_export
            )
            b = BroadcastConfig(mode="filesystem", export=mode.partition("-")[0], hash=False)
            pub = FilesystemPublisher(run / mode, cfg, b, async_level=0)
            rows[mode] = [pub.publish(r, model) for r in range(a.rounds + 1)][1:]
    else:
        b = BroadcastConfig(
            mode="collective", bucket_mb=a.bucket_mb, transfer_timeout_s=600, workers_per_server=a.receivers
        )
        pub = make_publisher(
            b, run, cfg, async_level=1, max_steps=10**6, checkpoint_interval=0, num_receivers=a.receivers
        )
        pub.sender().stacks = pub.sender().fused_experts = a.path == "new"  # old: per tensor, before issue 47
        times = []
        for r in range(a.rounds + 1):
            t0 = time.perf_counter()
            m = pub.publish(r, model)
            if "transfer/failed" in m:
                raise RuntimeError(f"round {r} failed")
            times.append(time.perf_counter() - t0)
        rows["collective"] = times[1:]
        rows["gb_sent"] = m["transfer/gb"]
    if a.pid == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def receiver(a: argparse.Namespace) -> None:
    import torch

    from primejax.inference.admin_auth import process_token
    from primejax.transports.weights.collective import wire

    gpu = not (a.smoke or a.cpu)
    device = torch.device("cuda", a.gpu) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    tp_rank, tp = a.rank - 1, a.receivers
    store: dict[str, torch.Tensor] = {}

    def put(name: str, t, lead: int) -> None:  # this worker's TP slice of t (`lead` stacking axes), one copy
        dim = lead if any(k in name for k in COLUMN) else lead + 1 if any(k in name for k in ROW) else None
        if dim is not None and t.dim() > lead + 1:
            t = t.narrow(dim, tp_rank * (t.shape[dim] // tp), t.shape[dim] // tp)
        if name not in store:
            store[name] = torch.empty(t.shape, dtype=t.dtype, device=device)
        store[name].copy_(t, non_blocking=True)

    def load(pairs) -> None:
        for name, t in pairs:
            put(name, t, 0)

    class Stacked:  # issue 47: a run of equal tensors (a layer's experts) in one sliced copy, as fused.py loads
        __call__ = staticmethod(load)
        stacked = staticmethod(lambda names, t: put(names[0], t, 1))

    rx = wire.Receiver()
    run = Path(a.run_dir)
    for offer in offers(run, a.rounds + 1):
        how = Stacked() if offer.init_info.get("fused_experts") else load
        rx.receive(offer.init_info, offer.update_info, a.rank, device, how, process_token())


def add_multi_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--export", action="store_true", help="the filesystem export (gather vs parallel)")
    ap.add_argument("--shapes", default="qwen3-8b,qwen3-30b-a3b")
    ap.add_argument(
        "--senders", default="", help="collective rows: trainer processes (one GPU each), e.g. 1,2"
    )
    ap.add_argument("--processes", default="4", help="export rows: trainer processes (one GPU each)")
    ap.add_argument(
        "--receivers", type=int, default=2, help="tensor-parallel workers of the receiving server"
    )
    ap.add_argument("--receiver-gpus", default="2,3")
    ap.add_argument(
        "--export-modes",
        default="gather,parallel",
        help="export rows: which of gather, parallel, parallel-pwrite (the writer before mmap)",
    )
    ap.add_argument("--paths", default="new", help="collective rows: old (per tensor, before issue 47), new")
    for flag, default in (("--path", "new"), ("--shape", ""), ("--coordinator", "")):
        ap.add_argument(flag, default=default, help="a row's process")
    for flag, default in (("--pid", 0), ("--nproc", 1), ("--rank", 1), ("--gpu", 0)):
        ap.add_argument(flag, type=int, default=default, help="a row's process")


def multi(a: argparse.Namespace) -> int:
    from primejax.inference.server import free_port

    if a.role == "sender":
        sender(a)
        return 0
    if a.role == "receiver":
        receiver(a)
        return 0
    table = []
    counts = a.processes if a.export else a.senders
    for shape in a.shapes.split(","):
        for n in (int(x) for x in counts.split(",")):
            for path in ["new"] if a.export else a.paths.split(","):
                row = ["--shape", shape, "--path", path, "--nproc", str(n)]
                row += ["--coordinator", f"127.0.0.1:{free_port()}"]
                tx = [["--role", "sender", "--pid", str(k), *row] for k in range(n)]
                gpus = a.receiver_gpus.split(",")
                rx = [
                    ["--role", "receiver", "--rank", str(r), "--gpu", gpus[r - 1], *row]
                    for r in range(1, a.receivers + 1)
                ]
                with tempfile.TemporaryDirectory(prefix="bench-transfer-", dir=a.tmp) as run:
                    res = launch(a, run, tx + ([] if a.export else rx))
                print(json.dumps({"shape": shape, "processes": n, "path": path, **res}), flush=True)
                table.append((shape, n, res if a.export else {**res, "path": path}))  # export: modes only
    where = "CPU smoke (gloo, tiny shapes)" if a.smoke else "CPU (gloo)" if a.cpu else "GPU"
    if a.export:
        print(f"\n{where}: filesystem export, median of {a.rounds} after a warm-up\n")
        print("| shape | processes | GB | export | s | GB/s |\n|---|---|---|---|---|---|")
        for shape, n, res in table:
            gb = next(iter(res.values()))[0]["export/gb"]
            for mode, v in res.items():
                sec = statistics.median(m["export/seconds"] for m in v)
                print(f"| {shape} | {n} | {gb:.2f} | {mode} | {sec:.2f} | {gb / sec:.2f} |")
    else:
        print(
            f"\n{where}: collective update to {a.receivers} TP workers, bucket {a.bucket_mb} MiB, median of "
            f"{a.rounds} after a warm-up\n"
        )
        print("| shape | senders | path | s/update | GB sent by process 0 |\n|---|---|---|---|---|")
        for shape, n, res in table:
            sec = statistics.median(res["collective"])
            print(f"| {shape} | {n} | {res['path']} | {sec:.3f} | {res['gb_sent']:.2f} |")
    return 0
