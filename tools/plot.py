"""Plot a run's reward, loss, entropy and mismatch-KL curves from its metrics JSONL (no TensorBoard needed).

python -m tools.plot outputs/demo [--out outputs/demo/curves.png]
python -m tools.plot outputs/demo outputs/demo-lora --out both.png   # several runs overlaid, one line each
"""

from __future__ import annotations

import argparse
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


def plot(run_dir: str | Path | list, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    runs = [Path(r) for r in (run_dir if isinstance(run_dir, (list, tuple)) else [run_dir])]
    out = Path(out) if out else runs[0] / "curves.png"
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (process, key, title) in zip(axes, PANELS, strict=True):
        found = False
        for run in runs:
            steps, values = series(run, process, key)
            ax.plot(steps, values, marker="o", markersize=3, label=run.name)
            found = found or bool(steps)
        if len(runs) > 1:
            ax.legend(fontsize=7)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if not found:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(" vs ".join(r.name for r in runs))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="+", help="one run directory, or several to overlay")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    for run in args.run_dir:
        if not RunDir(run).metrics("trainer").parent.is_dir():
            parser.exit(2, f"error: {run} has no metrics/ directory (is it a primejax run dir?)\n")
    print(plot(args.run_dir, args.out))


if __name__ == "__main__":
    main()
