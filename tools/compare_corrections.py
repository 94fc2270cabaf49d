"""Off-policy corrections side by side on CPU: `python -m tools.compare_corrections [--steps 40] [--only a,b] [--report]`.

The offline demo (configs/demo.py, reverse-text on a tiny character-level Qwen3) with a deliberately
mismatched sampler: vLLM serves in bfloat16 while the trainer computes in float32, and the orchestrator runs
`async_level` 2 steps ahead. One SFT warm-up (the first run's, at the demo's seed) is shared by every run;
then each correction trains from it with the same seeds. Writes `<out>/compare.json` (per run and step:
reward, mismatch KL, masked / rejected fractions, IS weight), `<out>/compare.md` (the table) and
`<out>/compare.png` (reward and mismatch-KL curves). Measured results: docs/algorithms.md#corrections.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from primejax.contracts.rundir import RunDir
from primejax.utils.io import atomic_write_text
from primejax.utils.monitor import read_jsonl

A = "--config.orchestrator.algo.correction."
# name -> the overrides of its algorithm block's correction (docs/algorithms.md#corrections)
VARIANTS: dict[str, list[str]] = {
    "dppo": [],
    "tis": [A + "is_weight.level=token", A + "is_weight.cap=2.0"],
    "mis_seq": [
        A + "reject.level=sequence",
        A + "reject.divergence=k3",
        A + "reject.low=0.0",
        A + "reject.high=0.02",
    ],
    "icepop": [A + "icepop.enabled=True", A + "icepop.low=0.5", A + "icepop.high=2.0"],
    "gspo": [A + "objective=gspo"],
    "cispo": [A + "objective=cispo"],
}
MISMATCH = [
    "--config.inference.dtype=bfloat16",
    "--config.model.compute_dtype=float32",
    "--config.orchestrator.async_level=2",
]
# a free port (other runs may hold 8000) and room for a slow server start on a busy machine
HOST = ["--config.inference.port=0", "--config.inference.startup_timeout_s=1200"]


def run(name: str, out: Path, steps: int, extra: list[str], log) -> float:
    cmd = [
        sys.executable,
        "-m",
        "primejax.train",
        "--config",
        "configs/demo.py",
        f"--config.run.name={name}",
        f"--config.run.output_dir={out}",
        f"--config.run.max_steps={steps}",
        *MISMATCH,
        *HOST,
        *extra,
    ]
    log(f"$ {' '.join(cmd)}")
    start = time.monotonic()
    with open(out / f"{name}.log", "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - start
    log(f"  {name}: exit {rc} after {seconds:.0f}s")
    if rc != 0:
        raise SystemExit(f"error: run {name} failed (exit {rc}); see {out / f'{name}.log'}")
    return seconds


def collect(run_dir: Path) -> list[dict]:
    """Per step: reward (orchestrator) and the trainer's correction metrics."""
    rd = RunDir(run_dir)
    orch = {r["step"]: r for r in read_jsonl(rd.metrics("orchestrator")) if "reward/mean" in r}
    rows = []
    for t in read_jsonl(rd.metrics("trainer")):
        if "loss" not in t:
            continue
        s = t["step"]
        env = "corrections/env/reverse_text/"
        rows.append(
            {
                "step": s,
                "reward": orch.get(s, {}).get("reward/mean"),
                "mismatch_kl": t.get("mismatch_kl"),
                "masked_frac": t.get(env + "masked_frac"),
                "rejected_frac": t.get(env + "rejected_frac"),
                "seq_masked_frac": t.get(env + "seq_masked_frac"),
                "is_weight_mean": t.get(env + "is_weight_mean"),
                "is_weight_max": t.get(env + "is_weight_max"),
                "grad_norm": t.get("grad_norm"),
            }
        )
    return sorted(rows, key=lambda r: r["step"])


def _mean(rows: list[dict], key: str, steps: range | None = None) -> float:
    """Mean over the steps that logged `key`; nan when none did (a NaN the run logged stays NaN)."""
    vals = [r[key] for r in rows if r.get(key) is not None and (steps is None or r["step"] in steps)]
    return statistics.fmean(vals) if vals else math.nan


def _max(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    if any(not math.isfinite(v) for v in vals):  # max() would drop a NaN depending on its position
        return math.nan
    return max(vals, default=math.nan)


def _f(x: float, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def table(results: dict[str, list[dict]], seconds: dict[str, float], steps: int) -> str:
    """One row per run with trainer steps; each run's last 5 steps are its own (a shorter run is marked).

    A run directory with no trainer step yet (still starting, or failed before step 1) gets no row of
    numbers but a line under the table: a report made while a run is starting once showed such a run as a
    row of NaNs, which read as a diverged run."""
    done = {n: rows for n, rows in results.items() if rows}
    base_rows = done.get("dppo", [])
    base = (
        _mean(base_rows, "reward", range(base_rows[-1]["step"] - 4, base_rows[-1]["step"] + 1))
        if base_rows
        else math.nan
    )
    lines = [
        "| correction | reward step 1 | reward (last 5 steps) | vs dppo | mismatch KL (mean) | masked tokens | "
        "rejected tokens | fully masked seqs | IS weight mean / max | grad norm max | time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in done.items():
        last_step = rows[-1]["step"]
        label = name if last_step >= steps else f"{name} (steps 1-{last_step} of {steps})"
        first = rows[0]["reward"] if rows[0]["step"] == 1 and rows[0]["reward"] is not None else math.nan
        r_last = _mean(rows, "reward", range(last_step - 4, last_step + 1))
        secs = seconds.get(name) if last_step >= steps else None
        lines.append(
            f"| {label} | {first:.3f} | {r_last:.3f} | {r_last - base:+.3f} | {_mean(rows, 'mismatch_kl'):.2e} | "
            f"{_mean(rows, 'masked_frac'):.3f} | {_mean(rows, 'rejected_frac'):.3f} | "
            f"{_mean(rows, 'seq_masked_frac'):.3f} | {_mean(rows, 'is_weight_mean'):.3f} / "
            f"{_max(rows, 'is_weight_max'):.2f} | {_max(rows, 'grad_norm'):.2f} | {_f(secs, '.0f')}{'s' if secs else ''} |"
        )
    missing = [n for n, rows in results.items() if not rows]
    if missing:
        lines.append("")
        lines.append(
            f"No trainer step yet (running, or failed before step 1; see <name>.log): {', '.join(missing)}"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, list[dict]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (
        ("reward", "reward (mean)"),
        ("mismatch_kl", "trainer-vLLM mismatch KL"),
        ("masked_frac", "masked token fraction"),
    )
    fig, axes = plt.subplots(1, len(keys), figsize=(4.4 * len(keys), 3.4))
    for ax, (key, title) in zip(axes, keys, strict=True):
        for name, rows in results.items():
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=name, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "mismatch_kl":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("demo, bf16 serving / fp32 trainer, async_level 2")
    fig.tight_layout()
    path = out / "compare.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="RL steps per run (default 40; --report: the longest finished run's)",
    )
    parser.add_argument("--out", default="outputs/compare_corrections")
    parser.add_argument("--only", default="", help="comma-separated subset of " + ", ".join(VARIANTS))
    parser.add_argument(
        "--report", action="store_true", help="only rebuild the table and plot from finished runs"
    )
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or (args.steps is not None and args.steps <= 0):
        parser.exit(
            2,
            f"error: unknown variant(s) {unknown} (known: {', '.join(VARIANTS)})\n"
            if unknown
            else "error: --steps must be > 0\n",
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    seconds: dict[str, float] = {}
    if (out / "seconds.json").is_file():  # runs of an earlier invocation keep their times
        seconds = json.loads((out / "seconds.json").read_text())
    if not args.report:
        warm = RunDir(out / "warmup").sft_final
        steps = args.steps or 40
        for name in names:
            if (warm / "config.json").is_file():  # every run starts from the same SFT warm-up
                extra = [
                    f"--config.model.path={warm}",
                    "--config.model.build_tiny.enabled=False",
                    "--config.sft.steps=0",
                ]
                seconds[name] = run(name, out, steps, VARIANTS[name] + extra, log)
            else:  # the first run does the warm-up (the demo's SFT) in its own run dir; keep a copy
                seconds[name] = run(name, out, steps, VARIANTS[name], log)
                shutil.copytree(RunDir(out / name).sft_final, warm)
            atomic_write_text(out / "seconds.json", json.dumps(seconds))
    results = {n: collect(out / n) for n in VARIANTS if RunDir(out / n).metrics("trainer").is_file()}
    atomic_write_text(out / "compare.json", json.dumps(results, indent=1))
    steps = args.steps or (
        max((r[-1]["step"] for r in results.values() if r), default=40) if args.report else 40
    )
    md = table(results, seconds, steps)
    atomic_write_text(out / "compare.md", md)
    print(md)
    print(plot(results, out))


if __name__ == "__main__":
    main()
