"""A trainer-side sender in its own process, for fault tests: sends a weight directory's tensors collectively
and, with `--fault kill|stop`, SIGKILLs or SIGSTOPs itself after `--after` bucket broadcasts (mid-transfer).

    python sender_proc.py RUN_DIR WEIGHT_DIR STEP [--fault kill|stop --after N] [--timeout S] [--bucket-bytes B]
        [--nccl]                 # NCCL from GPU 0 (tests/gpu) instead of gloo from host memory
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from safetensors.numpy import load_file

from primejax.inference.admin_auth import process_token
from primejax.transports.weights.collective import wire
from primejax.transports.weights.collective.sender import CollectiveSender, to_torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("weight_dir")
    ap.add_argument("step", type=int)
    ap.add_argument("--fault", choices=("none", "kill", "stop"), default="none")
    ap.add_argument("--after", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--bucket-bytes", type=int, default=4096)
    ap.add_argument("--nccl", action="store_true")
    a = ap.parse_args()
    tensors = {}
    for f in sorted(os.listdir(a.weight_dir)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(a.weight_dir, f)))
    named = [(n, to_torch(t)) for n, t in sorted(tensors.items())]
    device = None
    if a.nccl:
        import torch

        device = torch.device("cuda", 0)
        named = [(n, t.to(device)) for n, t in named]
    if a.fault != "none":
        broadcast, calls = wire.TorchGroup.broadcast, [0]

        def faulty(self, tensor, src=0):
            if calls[0] == a.after:
                os.kill(os.getpid(), signal.SIGKILL if a.fault == "kill" else signal.SIGSTOP)
            calls[0] += 1
            broadcast(self, tensor, src)

        wire.TorchGroup.broadcast = faulty
    sender = CollectiveSender(
        a.run_dir,
        secret=process_token(),
        timeout_s=a.timeout,
        bucket_bytes=a.bucket_bytes,
        backend="nccl" if a.nccl else "gloo",
        device=device,
    )
    ok = sender.send(a.step, named)
    print("SENT" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
