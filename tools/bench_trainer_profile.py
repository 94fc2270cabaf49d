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
    copies: dict[str, dict[str, list]] = {}  # per GPU: host<->device copies' (start, end, stream)
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
                direction = _copy_direction(ev.name) if target is kernels else None
                if direction:
                    copies.setdefault(plane.name, {}).setdefault(direction, []).append(
                        (ev.start_ns, ev.start_ns + ev.duration_ns, line.name)
                    )

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
        host_copies=_copy_overlap(copies, steps),
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
    kernels by name, and the first GPU's in order."""
    out = {}
    for n, (plane, by_kind) in enumerate(sorted(spans.items())):
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
        if n == 0:  # one GPU's collectives in order: [start ms, ms, ms with no compute beside it, kernel]
            out[plane]["nccl_timeline"] = [
                [round((a - t0) / 1e6, 2), round((b - a) / 1e6, 2), round(alone / 1e6, 2), name[14:]]
                for a, b, name, alone in events
            ]
    return out


def _copy_direction(name: str) -> str | None:
    n = name.lower().replace("to", "2")
    return "h2d" if "memcpyh2d" in n else "d2h" if "memcpyd2h" in n else None


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _copy_overlap(copies: dict, steps: int) -> dict:
    """Per GPU, ms per step: time host-to-device copies ran, device-to-host copies ran, both at once, and the
    streams they ran on (one stream for both directions means they take turns)."""
    out = {}
    for plane, by_dir in copies.items():
        h2d = _union([(a, b) for a, b, _ in by_dir.get("h2d", [])])
        d2h = _union([(a, b) for a, b, _ in by_dir.get("d2h", [])])
        both = _intersect(h2d, d2h)
        out[plane] = dict(
            h2d_ms=round(sum(b - a for a, b in h2d) / 1e6 / steps, 1),
            d2h_ms=round(sum(b - a for a, b in d2h) / 1e6 / steps, 1),
            both_ms=round(both / 1e6 / steps, 1),
            streams={d: sorted({s for *_, s in v}) for d, v in by_dir.items()},
        )
    return out


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
