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
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.bench_multigpu_workers import main as worker_main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
K = 1024


def _train(
    name,
    model,
    gpus,
    seq,
    *,
    rows=None,
    layers=None,
    fsdp=-1,
    context=1,
    tensor=1,
    remat="attn",
    save_gib=0.0,
    steps=2,
    warmup=1,
    io=None,
    alts=(),
    baseline=None,
    scan=False,
    timeout=None,
):
    """A training row: `seq` tokens per row, `rows` rows per step (default one row per data-parallel GPU)."""
    rows = rows or max(1, gpus // (context * tensor))
    return dict(
        kind="train",
        name=name,
        model=model,
        gpus=gpus,
        seq=seq,
        rows=rows,
        layers=layers,
        fsdp=fsdp,
        context=context,
        tensor=tensor,
        remat=remat,
        save_gib=save_gib,
        steps=steps,
        warmup=warmup,
        io=io,
        alts=list(alts),
        baseline=baseline,
        scan=scan,
        timeout=timeout,
    )


# Memory plan (80 GB H100; docs/scaling.md): fp32 params + AdamW moments + fp32 grads are 16 B/param, so
# 4B is 64 GB on one card (too close with activations: the 1-GPU rows fall back to 18 of its 36 layers) and
# 8B (8.2B with its untied head) never fits one card (8 of its layers do). On 4 cards the state is 16 / 33 GB
# per card; remat "attn" keeps per layer only the layer input and cuDNN's attention output (~13 kB per token
# for 4B, 16 kB for 8B), so 64k tokens per GPU holds ~31 / 39 GB of residuals: 4B fits, 8B is at the edge and
# falls back to "full" remat (layer inputs only, 8 kB per token). The head recomputes its logits (save_gib 0):
# keeping 15 GB of logits per 16k tokens would not fit next to the state.
SUITE = [
    # 1-2 GPUs each, side by side on disjoint GPUs
    dict(
        kind="layout",
        name="node-layout",
        model="qwen3-0.6b",
        gpus=2,
        seq=8 * K,
        rows=1,
        steps=3,
        warmup=1,
        layers=8,
        remat="attn",
        save_gib=0.0,
    ),
    _train("weak:4b:2", "qwen3-4b", 2, 16 * K, baseline="weak:4b:1"),
    _train("weak:4b:1", "qwen3-4b", 1, 16 * K, alts=[dict(layers=18, name="weak:4b@L18:1")]),
    _train("1gpu:8b@L8:16k", "qwen3-8b", 1, 16 * K, layers=8),
    _train("1gpu:4b@L18:64k", "qwen3-4b", 1, 64 * K, layers=18, steps=1, warmup=0),
    _train("1gpu:8b@L8:64k", "qwen3-8b", 1, 64 * K, layers=8, steps=1, warmup=0, alts=[dict(remat="full")]),
    # all 4 GPUs, in order of priority (a --budget skips from the end)
    _train("weak:4b:4", "qwen3-4b", 4, 16 * K, baseline="weak:4b:1"),
    _train("8b:16k:fsdp4", "qwen3-8b", 4, 16 * K, baseline="1gpu:8b@L8:16k", io="params", timeout=420),
    _train(
        "cp:4b:128k",
        "qwen3-4b",
        4,
        128 * K,
        rows=1,
        fsdp=1,
        context=4,
        steps=1,
        warmup=0,
        baseline="1gpu:4b@L18:64k",
        alts=[dict(remat="attn_offload")],
    ),
    _train(
        "cp:4b:256k",
        "qwen3-4b",
        4,
        256 * K,
        rows=1,
        fsdp=1,
        context=4,
        steps=1,
        warmup=0,
        baseline="1gpu:4b@L18:64k",
        alts=[dict(remat="attn_offload"), dict(remat="full")],
        timeout=300,
    ),
    _train(
        "4b:64k:fsdp4",
        "qwen3-4b",
        4,
        64 * K,
        steps=1,
        warmup=0,
        baseline="1gpu:4b@L18:64k",
        alts=[dict(remat="attn_offload"), dict(remat="full")],
    ),
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
        steps=1,
        warmup=0,
        baseline="1gpu:8b@L8:64k",
        alts=[dict(remat="full")],
    ),
    _train("4b:16k:fsdp2-tensor2", "qwen3-4b", 4, 16 * K, rows=2, fsdp=2, tensor=2, baseline="weak:4b:1"),
]
SMOKE_SEQ = 64  # --smoke divides every length by this (16k -> 256 tokens) and runs tiny shapes on CPU


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
        from tools.bench_multigpu_checks import run_layout

        return run_layout(spec, gpu_ids, args, Job)
    if spec["kind"] == "multiproc":
        from tools.bench_multigpu_checks import run_multiproc

        return run_multiproc(spec, gpu_ids, args, Job, _free_port)
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
    from tools.bench_multigpu_checks import table

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
    from tools.bench_multigpu_checks import table

    print(table(results))
    print(f"\nsuite wall clock {time.perf_counter() - t0:.0f} s; results in {args.out}/results.json")


if __name__ == "__main__":
    main()
