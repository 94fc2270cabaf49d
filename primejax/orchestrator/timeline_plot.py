"""A step's timeline (primejax.orchestrator.timeline's Chrome trace) drawn as horizontal bars with matplotlib:
the step's phases, the weight updates, then one row per group with its rollouts' requests, waits, env and tool
work overlaid; weight updates shaded across every row. `tools/plot.py --timeline` saves it as a PNG; the
orchestrator logs it as an image to TensorBoard and W&B every `monitor.timeline_image_every` steps.

matplotlib is optional (the `plot` and `test` extras): `available()` says whether it can draw.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

COLORS = {
    "phase": "#9e9e9e",
    "request": "#1f77b4",
    "wait": "#ff7f0e",
    "env": "#2ca02c",
    "tool": "#9467bd",
    "weights": "#d62728",
}


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _row(lane: str, thread: str) -> str:
    """The plot's row of a trace thread: a rollout's track folds into its group's row."""
    return f"{lane}: {thread.split(' · ')[0]}"


def draw(trace: dict[str, Any], title: str, max_rows: int = 0) -> Any:
    """The trace as a matplotlib Figure (the caller closes it); `max_rows` > 0 keeps the first rows only and says
    how many groups were left out. ValueError for a trace without spans."""
    import matplotlib

    matplotlib.use("Agg")  # files and arrays only; never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = trace["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        raise ValueError("the trace holds no spans")
    t0 = min(e["ts"] for e in spans)
    span_s = (max(e["ts"] + e["dur"] for e in spans) - t0) / 1e6
    rows = list(
        dict.fromkeys(
            _row(lanes[e["pid"]], threads[(e["pid"], e["tid"])])
            for e in sorted(spans, key=lambda e: (e["pid"], e["tid"]))
        )
    )
    left_out = len(rows) - max_rows if 0 < max_rows < len(rows) else 0
    rows = rows[: len(rows) - left_out]
    index = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(13, max(3.0, 0.28 * len(rows) + 1.5)))
    for e in spans:
        lane, thread = lanes[e["pid"]], threads[(e["pid"], e["tid"])]
        y = index.get(_row(lane, thread))
        if y is None:
            continue
        cat = "tool" if e["name"] == "tool" else e.get("cat", "phase")
        start, width = (e["ts"] - t0) / 1e6, max(e["dur"] / 1e6, 1e-4)
        step_lane = lane == "step"  # its phases abut: white edges between them
        ax.broken_barh(
            [(start, width)],
            (y - 0.4, 0.8),
            color=COLORS.get(cat, "#17becf"),
            alpha=0.35 if lane == "groups" else 0.9,
            edgecolor="white",
            linewidth=1.0 if step_lane else 0,
        )
        if lane == "weights" and thread == "orchestrator":
            ax.axvspan(start, start + width, color=COLORS["weights"], alpha=0.08)
        if step_lane and width > 0.03 * span_s:  # a label that fits its bar
            ax.text(start + width / 2, y, e["name"], ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(
        "seconds since the step's first span" + (f" ({left_out} more groups not drawn)" if left_out else "")
    )
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLORS.items()],
        fontsize=7,
        ncol=len(COLORS),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 if len(rows) > 8 else -0.25),
    )
    ax.set_title(title)
    fig.tight_layout()
    return fig


def to_image(trace: dict[str, Any], title: str, max_rows: int = 64, dpi: int = 80) -> np.ndarray:
    """The drawing as an RGB uint8 array [height, width, 3] (for TensorBoard and W&B images)."""
    import matplotlib.pyplot as plt

    fig = draw(trace, title, max_rows)
    try:
        fig.set_dpi(dpi)
        fig.canvas.draw()
        return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    finally:
        plt.close(fig)
