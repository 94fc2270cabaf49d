"""What tools/bench_trainer.py and tools/bench_moe.py share: the suite driver (every row in its own process, so an
OOM stays contained and peak-memory counters start clean), timing, the profiler trace summary, XLA's memory
analysis. Never imported by the package."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

GIB = 2.0**30


def run_child(script: str, c: dict, timeout: float, env: dict) -> dict:
    """Row `c` in `script --worker` in its own process: its RESULT line, or why there is none (a timeout keeps
    the worker's last PROGRESS lines; an OOM keeps its own line: how much was asked for, where)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, script, "--worker", json.dumps(c)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        done = [ln for ln in err.splitlines() if ln.startswith("PROGRESS ")]
        return dict(
            c, error=f"timeout after {timeout:.0f}s" + (f"; last: {' | '.join(done[-4:])}" if done else "")
        )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        tail = (p.stderr or p.stdout)[-2000:]
        why = [ln for ln in tail.splitlines() if "RESOURCE_EXHAUSTED" in ln or "out of memory" in ln.lower()]
        error = "OOM: " + why[0].strip()[:400] if why else tail
        return dict(c, oom=bool(why), error=error, wall_s=time.perf_counter() - t0)
    return dict(c, **json.loads(lines[-1][7:]), wall_s=time.perf_counter() - t0)


def bench_main(
    doc: str,
    suites: dict[str, list[dict]],
    workers: dict[str, Callable[[dict], dict]],
    table: Callable[[list[dict]], str],
    env: Callable[[dict, bool], dict],
    *,
    script: str,
    suite: str,
    timeout: float,
) -> None:
    """A bench's command line: `--suite`'s rows (`--only` some, in the order given), each through `run_child`
    with `env(row, smoke)`, one JSON line each to `--out`/<script>.jsonl, the table last. A row marked
    `fallback` runs only if no row before it ran; one whose `skip_if_oom` row ran out of memory is skipped."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--suite", default=suite, choices=sorted(suites))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (= --suite smoke)")
    ap.add_argument("--only", default="", help="comma-separated row names, run in this order")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds per row")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds for the whole suite (0 = none)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        c = json.loads(args.worker)
        print("RESULT " + json.dumps(workers[c["kind"]](c)), flush=True)
        return
    name = "smoke" if args.smoke and not args.suite.startswith("smoke") else args.suite
    rows = suites[name]
    if args.only:
        by_name = {c["name"]: c for c in rows}  # in the order given: the budget goes to the first
        rows = [by_name[n] for n in args.only.split(",") if n in by_name]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, start = [], time.perf_counter()
    for c in rows:
        left = args.budget - (time.perf_counter() - start) if args.budget else args.timeout
        if left < 20:
            results.append(dict(c, error="skipped: suite budget spent"))
            continue
        if c.get("fallback") and any(r.get("tok_s") for r in results):
            continue
        if any(r["name"] == c.get("skip_if_oom") and r.get("oom") for r in results):
            results.append(dict(c, error="skipped: a config needing less memory ran out"))
            continue
        r = run_child(script, c, min(args.timeout, left), env(c, args.smoke or name.startswith("smoke")))
        results.append(r)
        print(json.dumps(r)[:3000], flush=True)
        with (out / f"{Path(script).stem}.jsonl").open("a") as f:
            f.write(json.dumps(r) + "\n")
    print("\n" + table(results))


def time_engine_step(engine, host: dict, kind: str, segs: int, c: dict, on_step=None, progress=None) -> dict:
    """The engine's compiled step (trainer/engine.py) on `host`'s batch: compile time, then `c["warmup"]` calls
    and `c["steps"]` timed back-to-back calls (`_timed`), the loss after, a GPU trace if `c["trace"]`."""
    import jax

    batch = engine.device_batch(host)
    t0 = time.perf_counter()
    step = engine.lower(batch, kind, segs).compile()
    compile_s = time.perf_counter() - t0
    if progress is not None:
        progress("compiled")
    frozen = engine._frozen_arg()  # LoRA: the frozen weights are the step's third argument

    def run(b):
        engine.state, metrics = step(engine.state, b, *frozen)
        if on_step is not None:
            on_step(metrics)
        return metrics["loss"]

    with jax.set_mesh(engine.mesh):
        first, dt = _timed(run, lambda: (batch,), c["steps"], c["warmup"])
        loss = float(run(batch))
        trace = _trace_summary(run, batch) if c.get("trace") and jax.default_backend() == "gpu" else None
    return dict(
        compile_s=compile_s,
        first_step_s=first,
        step_s=dt,
        loss=loss,
        trace=trace,
        memory=_memory_analysis(step),
        peak_gib=_jax_peak_gib(),
    )


def lora_options(rank: int) -> dict:
    """ModelConfig keywords of a LoRA row: rank-`rank` adapters (alpha 2 x rank) on the default targets; {} for 0."""
    from primejax.models.lora import DEFAULT_TARGETS

    return dict(lora_rank=rank, lora_alpha=2.0 * rank, lora_targets=DEFAULT_TARGETS) if rank else {}


def rel(a, b) -> float:
    """Relative error ||a - b|| / ||b|| in float64."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _timed(fn, args_fn, steps: int, warmup: int) -> tuple[float, float]:
    """(first-call seconds incl. compile, median-free mean seconds per call over `steps` back-to-back calls)."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args_fn()))
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        jax.block_until_ready(fn(*args_fn()))
    t0 = time.perf_counter()
    out = None
    for _ in range(steps):
        out = fn(*args_fn())
    jax.block_until_ready(out)
    return first, (time.perf_counter() - t0) / steps


# A GPU kernel's category by its name, first match wins.
KERNEL_CATEGORIES = (
    ("attention", ("fmha", "sdpa", "flash", "cudnn", "fprop", "dgrad")),
    ("matmul", ("gemm", "xmma", "cutlass", "cublas", "matmul", "gmma", "nvjet")),
    ("fusion/elementwise", ("reduce", "fusion", "loop", "copy", "transpose", "convert", "scatter", "gather")),
)


def _trace_summary(run, batch, steps: int = 2, top: int = 60) -> dict:
    """GPU time per step from a jax.profiler trace: by category and the top kernels / XLA ops."""
    import collections
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData

    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        out = None
        for _ in range(steps):
            out = run(batch)
        jax.block_until_ready(out)
    pb = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]
    kernels: dict[str, float] = collections.defaultdict(float)
    ops: dict[str, float] = collections.defaultdict(float)
    lines_seen = []
    spans: dict[str, dict[str, list]] = {}  # per GPU: every kernel's (start, end) by compute / nccl / copy
    collectives: dict[str, list] = {}  # per GPU: each NCCL kernel's (start, end, name)
    for plane in ProfileData.from_file(pb).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            lines_seen.append(line.name)
            target = ops if line.name == "XLA Ops" else kernels if line.name.startswith("Stream") else None
            if target is None:
                continue
            for ev in line.events:
                target[ev.name] += ev.duration_ns / 1e6 / steps
                if target is kernels:
                    kind = _kernel_kind(ev.name)
                    spans.setdefault(plane.name, {}).setdefault(kind, []).append(
                        (ev.start_ns, ev.start_ns + ev.duration_ns)
                    )
                    if kind == "nccl":  # which collective, for its exposed share
                        collectives.setdefault(plane.name, []).append(
                            (ev.start_ns, ev.start_ns + ev.duration_ns, ev.name.split("(")[0])
                        )

    cats: dict[str, float] = collections.defaultdict(float)
    for k, v in kernels.items():
        n = k.lower()
        cats[next((c for c, keys in KERNEL_CATEGORIES if any(x in n for x in keys)), "other")] += v
    best = lambda d: dict(sorted(((k[:140], round(v, 2)) for k, v in d.items()), key=lambda x: -x[1])[:top])  # noqa: E731
    return dict(
        ms_per_step_by_category={k: round(v, 1) for k, v in cats.items()},
        kernel_ms_total=round(sum(kernels.values()), 1),
        top_kernels=best(kernels),
        top_xla_ops=best(ops),
        lines=sorted(set(lines_seen))[:20],
        busy=_busy(spans, collectives, steps),
    )


def _kernel_kind(name: str) -> str:
    n = name.lower()
    return "nccl" if "nccl" in n else "copy" if "memcpy" in n or "memset" in n else "compute"


def _length(spans: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in spans)


def _intersect(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> int:
    """Overlap, ns, of two sorted disjoint span lists."""
    both, i, j = 0, 0, 0
    while i < len(x) and j < len(y):
        both += max(0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return both


def _exposed(named: list, compute: list) -> list[tuple[int, int, str, int]]:
    """Each collective (start, end, name) with its ns that no compute kernel (sorted disjoint spans) runs beside."""
    import bisect

    ends = [b for _, b in compute]
    return [
        (a, b, name, b - a - _intersect([(a, b)], compute[bisect.bisect_right(ends, a) :]))
        for a, b, name in named
    ]


def _exposed_by_name(events: list, t0: int, window: int, steps: int) -> dict:
    """NCCL kernel name -> [ms run, ms with no compute beside it, first start as a fraction of the window]."""
    out: dict[str, list] = {}
    for a, b, name, alone in events:
        row = out.setdefault(name, [0.0, 0.0, 1.0])
        row[0] += (b - a) / 1e6 / steps
        row[1] += alone / 1e6 / steps
        row[2] = min(row[2], (a - t0) / max(window, 1))
    return {k: [round(x, 2) for x in v] for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}


def _busy(spans: dict, collectives: dict, steps: int) -> dict:
    """Per GPU, ms per step: the traced window, when some compute kernel ran, when NCCL ran, NCCL with no compute
    beside it (exposed communication), and nothing at all (idle: launch gaps, host waits); `collectives`' NCCL
    kernels by name."""
    out = {}
    for plane, by_kind in sorted(spans.items()):
        u = {k: _union(v) for k, v in by_kind.items()}
        every = _union([s for v in by_kind.values() for s in v])
        t0 = every[0][0] if every else 0
        window = every[-1][1] - t0 if every else 0
        nccl, compute = u.get("nccl", []), u.get("compute", [])
        events = _exposed(sorted(collectives.get(plane, [])), compute)
        out[plane] = dict(
            window_ms=round(window / 1e6 / steps, 1),
            compute_ms=round(_length(compute) / 1e6 / steps, 1),
            nccl_ms=round(_length(nccl) / 1e6 / steps, 1),
            nccl_exposed_ms=round((_length(nccl) - _intersect(nccl, compute)) / 1e6 / steps, 1),
            idle_ms=round((window - _length(every)) / 1e6 / steps, 1),
            nccl_exposed_by_kernel=_exposed_by_name(events, t0, window, steps),
        )
    return out


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _memory_analysis(compiled) -> dict:
    """XLA's buffer assignment for the compiled step, GiB: what the peak is made of."""
    try:
        m = compiled.memory_analysis()
        names = ("argument", "output", "alias", "temp", "generated_code")
        return {n: round(getattr(m, f"{n}_size_in_bytes") / GIB, 2) for n in names}
    except Exception as e:  # noqa: BLE001 - informational only
        return {"error": repr(e)[:200]}


def _jax_peak_gib() -> float:
    import jax

    stats = jax.devices()[0].memory_stats() or {}  # None on CPU
    return stats.get("peak_bytes_in_use", 0) / GIB
