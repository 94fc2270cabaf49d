"""Plot a run's curves from its metrics JSONL, its servers' metrics, or one step's timeline (no TensorBoard needed).

python -m tools.plot outputs/demo [--out outputs/demo/curves.png]
python -m tools.plot outputs/demo outputs/demo-lora --out both.png   # several runs overlaid, one line each
python -m tools.plot outputs/demo --servers       # each inference server's tokens/s, KV-cache use, queue, loads
python -m tools.plot outputs/demo --timeline 12   # step 12's trace (timeline/step_12.json): where its time went
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from primejax.contracts.rundir import RunDir
from primejax.utils.monitor import read_jsonl

PANELS = (
    ("orchestrator", "reward/mean", "reward (mean)"),
    ("trainer", "loss", "loss"),
    ("trainer", "entropy", "entropy"),
    ("trainer", "mismatch_kl", "trainer-vLLM mismatch KL"),
)


def series(run_dir: Path, process: str, key: str) -> tuple[list[int], list[float]]:
    rows = [r for r in read_jsonl(RunDir(run_dir).metrics(process)) if r.get(key) is not None]
    return [r["step"] for r in rows], [r[key] for r in rows]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _panel(ax, lines: list[tuple[str, list, list]], title: str) -> None:
    """One panel over steps: a line per (label, steps, values) that has points; "no data" when none has."""
    for label, steps, values in lines:
        if steps:
            ax.plot(steps, values, marker="o", markersize=3, label=label)
    if not ax.lines:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    elif len(lines) > 1:
        ax.legend(fontsize=7)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def _save(plt, fig, title: str, out: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot(run_dir: str | Path | list, out: str | Path | None = None) -> Path:
    plt = _pyplot()
    runs = [Path(r) for r in (run_dir if isinstance(run_dir, (list, tuple)) else [run_dir])]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (process, key, title) in zip(axes, PANELS, strict=True):
        _panel(ax, [(run.name, *series(run, process, key)) for run in runs], title)
    return _save(plt, fig, " vs ".join(r.name for r in runs), Path(out) if out else runs[0] / "curves.png")


SERVER_PANELS = (
    ("gen_tokens_per_s", "generated tokens / s"),
    ("prompt_tokens_per_s", "prompt tokens / s"),
    ("kv_cache_usage", "KV-cache usage (mean in step)"),
    ("running", "requests running (mean)"),
    ("waiting", "requests waiting (mean)"),
    ("weight_update_s", "weight load s (per step)"),
)


def plot_servers(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """One panel per server metric (primejax.orchestrator.server_stats), one line per server and the total."""
    plt = _pyplot()
    run = Path(run_dir)
    rows = read_jsonl(RunDir(run).metrics("orchestrator"))
    servers = sorted({int(m.group(1)) for r in rows for k in r if (m := re.match(r"server/(\d+)/", k))})
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.4))
    for ax, (key, title) in zip(axes.flat, SERVER_PANELS, strict=True):
        names = [(f"server {i}", f"server/{i}/{key}") for i in servers]
        if len(servers) > 1 and key != "kv_cache_usage":
            names.append(("total", f"server/total/{key}"))
        found = [(label, [r for r in rows if r.get(name) is not None], name) for label, name in names]
        _panel(
            ax, [(label, [r["step"] for r in rs], [r[name] for r in rs]) for label, rs, name in found], title
        )
    return _save(plt, fig, f"{run.name}: inference servers", Path(out) if out else run / "servers.png")


def plot_timeline(run_dir: str | Path, step: int, out: str | Path | None = None) -> Path:
    """Step `step`'s trace as horizontal bars (primejax.orchestrator.timeline_plot)."""
    import matplotlib.pyplot as plt

    from primejax.orchestrator.timeline_plot import draw

    run = Path(run_dir)
    out = Path(out) if out else run / f"timeline_step_{step}.png"
    try:
        fig = draw(json.loads(RunDir(run).timeline(step).read_text()), f"{run.name}: step {step} timeline")
    except ValueError as e:
        raise SystemExit(f"error: {RunDir(run).timeline(step)}: {e}") from None
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="+", help="one run directory, or several to overlay")
    parser.add_argument("--out", default=None)
    parser.add_argument("--servers", action="store_true", help="the inference servers' metrics, per server")
    parser.add_argument("--timeline", type=int, default=None, metavar="STEP", help="one step's timeline")
    args = parser.parse_args()
    if (args.servers or args.timeline is not None) and len(args.run_dir) > 1:
        parser.exit(2, "error: --servers and --timeline take one run directory\n")
    for run in args.run_dir if args.timeline is None else []:
        if not RunDir(run).metrics("trainer").parent.is_dir():
            parser.exit(2, f"error: {run} has no metrics/ directory (is it a primejax run dir?)\n")
    if args.timeline is not None:
        if not RunDir(args.run_dir[0]).timeline(args.timeline).is_file():
            parser.exit(
                2,
                f"error: no {RunDir(args.run_dir[0]).timeline(args.timeline)} (monitor.timeline off, "
                "or the step has not run)\n",
            )
        print(plot_timeline(args.run_dir[0], args.timeline, args.out))
    elif args.servers:
        print(plot_servers(args.run_dir[0], args.out))
    else:
        print(plot(args.run_dir, args.out))


if __name__ == "__main__":
    main()
