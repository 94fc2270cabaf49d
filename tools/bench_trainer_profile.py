"""Measurement helpers of tools/bench_trainer.py: timing, the profiler trace summary, XLA's memory analysis.
Imported by the bench's worker processes (GPU), never by the package."""

from __future__ import annotations

import time

GIB = 2.0**30


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

    def cat(name: str) -> str:
        n = name.lower()
        if any(x in n for x in ("fmha", "sdpa", "flash", "cudnn", "fprop", "dgrad")):
            return "attention"
        if any(x in n for x in ("gemm", "xmma", "cutlass", "cublas", "matmul", "gmma", "nvjet")):
            return "matmul"
        if any(
            x in n for x in ("reduce", "fusion", "loop", "copy", "transpose", "convert", "scatter", "gather")
        ):
            return "fusion/elementwise"
        return "other"

    cats: dict[str, float] = collections.defaultdict(float)
    for k, v in kernels.items():
        cats[cat(k)] += v
    best = lambda d: dict(sorted(((k[:140], round(v, 2)) for k, v in d.items()), key=lambda x: -x[1])[:top])  # noqa: E731
    return dict(
        ms_per_step_by_category={k: round(v, 1) for k, v in cats.items()},
        kernel_ms_total=round(sum(kernels.values()), 1),
        top_kernels=best(kernels),
        top_xla_ops=best(ops),
        lines=sorted(set(lines_seen))[:20],
    )


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
