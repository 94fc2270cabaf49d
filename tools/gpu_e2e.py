"""Whole runs (`python -m primejax.train`) side by side on one GPU node, each on its own GPUs, with a table of what
a step costs and where its time went; the runs' metrics and logs packed into one archive.

    python3 tools/gpu_e2e.py --out $OUT --budget 540 \
        --run "single|0|configs/gpu_single.py" \
        --run "single_barrier|1|configs/gpu_single.py|--config.orchestrator.pool.mode=step --config.orchestrator.concurrency.mode=fixed"

Each `--run` is `NAME|GPUS|CONFIG[|OVERRIDES]` (GPUS: the run's CUDA_VISIBLE_DEVICES; the launcher places its
processes on them). A run still going at `--budget` seconds is interrupted (SIGINT: the launcher stops its
children and keeps what was written) and reported with the steps it finished. Writes `<out>/e2e.md` (the table),
`<out>/e2e.json` (per-run figures) and `<out>/e2e_runs.tar.gz` (each run's metrics/, logs/, configs/ and the
launcher's output). `--plot RUN_DIR... --png F` draws the runs' reward and mismatch-KL curves.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from primejax.contracts.rundir import RunDir  # noqa: E402


def _rows(path: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and isinstance(r.get("step"), int):
                out.setdefault(r["step"], {}).update(r)
    return out


def _mean(rows: list[dict], key: str, skip_first: bool = True) -> float | None:
    vals = [
        r[key]
        for r in rows[1 if skip_first and len(rows) > 2 else 0 :]
        if isinstance(r.get(key), (int, float))
    ]
    return statistics.fmean(vals) if vals else None


def summarize(run_dir: Path, wall_s: float, rc: int | None) -> dict:
    """One run's figures from its metrics JSONL (means skip step 1, which holds compilation)."""
    trainer = _rows(RunDir(run_dir).metrics("trainer"))
    orch = _rows(RunDir(run_dir).metrics("orchestrator"))
    steps = sorted(set(trainer) & set(orch))
    t_rows, o_rows = [trainer[s] for s in steps], [orch[s] for s in steps]
    rewards = [r.get("reward/mean") for r in o_rows if isinstance(r.get("reward/mean"), (int, float))]
    out = {
        "run": run_dir.name,
        "rc": rc,
        "wall_s": wall_s,
        "steps": len(steps),
        "reward_first3": statistics.fmean(rewards[:3]) if rewards else None,
        "reward_last5": statistics.fmean(rewards[-5:]) if rewards else None,
        "step_wall_s": _mean(o_rows, "time/step_wall"),
        "generate_s": _mean(o_rows, "time/generate"),
        "wait_weights_s": _mean(o_rows, "time/wait_for_weights"),
        "train_s": _mean(t_rows, "perf/step_s"),
        "trainer_wait_s": _mean(t_rows, "perf/wait_s"),
        "export_s": _mean(t_rows, "export/seconds"),
        "transfer_s": _mean(t_rows, "transfer/seconds"),
        "inference_tok_s": _mean(o_rows, "perf/inference_tokens_per_s"),
        "server_busy": _mean(o_rows, "server/busy_mean"),
        "mismatch_kl_step1": t_rows[0].get("mismatch_kl") if t_rows else None,
        "mismatch_kl_mean": _mean(t_rows, "mismatch_kl", skip_first=False),
        "rewards": rewards,
    }
    return out


def _fmt(v: object, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    lines = [
        "| run | steps | wall s | reward first 3 → last 5 | step wall s | generate s | wait weights s | train s |"
        " trainer wait s | export s | transfer s | inference tok/s | server busy | mismatch KL step 1 / mean |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['steps']} | {r['wall_s']:.0f} | {_fmt(r['reward_first3'], '.3f')} → "
            f"{_fmt(r['reward_last5'], '.3f')} | {_fmt(r['step_wall_s'], '.2f')} | {_fmt(r['generate_s'], '.2f')} | "
            f"{_fmt(r['wait_weights_s'], '.2f')} | {_fmt(r['train_s'], '.2f')} | {_fmt(r['trainer_wait_s'], '.2f')} | "
            f"{_fmt(r['export_s'], '.2f')} | {_fmt(r['transfer_s'], '.2f')} | {_fmt(r['inference_tok_s'], '.0f')} | "
            f"{_fmt(r['server_busy'], '.2f')} | {_fmt(r['mismatch_kl_step1'], '.1e')} / "
            f"{_fmt(r['mismatch_kl_mean'], '.1e')} |"
        )
    return "\n".join(lines)


def plot(run_dirs: list[Path], png: Path) -> None:
    """Reward and mismatch KL per step of each run (from its metrics JSONL) side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    for d in run_dirs:
        orch, trainer = _rows(RunDir(d).metrics("orchestrator")), _rows(RunDir(d).metrics("trainer"))
        steps = sorted(s for s in orch if isinstance(orch[s].get("reward/mean"), (int, float)))
        ax_r.plot(steps, [orch[s]["reward/mean"] for s in steps], label=d.name)
        kl = sorted(s for s in trainer if isinstance(trainer[s].get("mismatch_kl"), (int, float)))
        ax_k.semilogy(kl, [max(trainer[s]["mismatch_kl"], 1e-12) for s in kl], label=d.name)
    ax_r.set(xlabel="step", ylabel="mean reward", title="reward")
    ax_k.set(xlabel="step", ylabel="trainer vs vLLM (k3)", title="mismatch KL")
    ax_r.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--plot", nargs="+", default=None, help="run directories: draw their curves to --png, run nothing"
    )
    p.add_argument("--png", default="gpu_e2e.png")
    p.add_argument("--run", action="append", help="NAME|GPUS|CONFIG[|OVERRIDES]")
    p.add_argument("--out", help="where the table and the archive go (with --run)")
    p.add_argument("--runs-dir", default="outputs/gpu_e2e")
    p.add_argument(
        "--budget", type=float, default=540.0, help="seconds before still-running runs are interrupted"
    )
    args = p.parse_args()
    if args.plot:
        plot([Path(d) for d in args.plot], Path(args.png))
        return 0
    if not args.run or not args.out:
        p.error("--run and --out are required")
    out, runs_dir = Path(args.out), Path(args.runs_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    t0 = time.monotonic()
    for spec in args.run:
        name, gpus, config, *rest = spec.split("|")
        cmd = [
            sys.executable,
            "-m",
            "primejax.train",
            "--config",
            config,
            f"--config.run.name={name}",
            f"--config.run.output_dir={runs_dir}",
            *shlex.split(rest[0] if rest else ""),
        ]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "PYTHONUNBUFFERED": "1"}
        log = open(runs_dir / f"{name}.launcher.txt", "w")  # noqa: SIM115 (closed after the run)
        print(f"[{time.monotonic() - t0:6.0f}s] start {name} on GPU(s) {gpus}: {shlex.join(cmd)}", flush=True)
        procs.append(
            (
                name,
                subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                ),
                log,
                time.monotonic(),
            )
        )
    ends: dict[str, tuple[float, int | None]] = {}
    while len(ends) < len(procs):
        for name, proc, _, started in procs:
            if name not in ends and proc.poll() is not None:
                ends[name] = (time.monotonic() - started, proc.returncode)
                print(f"[{time.monotonic() - t0:6.0f}s] {name} exited {proc.returncode}", flush=True)
        if time.monotonic() - t0 > args.budget:
            for name, proc, _, started in procs:
                if name not in ends:
                    os.killpg(proc.pid, signal.SIGINT)
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                    ends[name] = (time.monotonic() - started, None)
                    print(f"[{time.monotonic() - t0:6.0f}s] {name} interrupted at the budget", flush=True)
        time.sleep(1.0)
    rows = []
    for name, _, log, _ in procs:
        log.close()
        wall, rc = ends[name]
        rows.append(summarize(runs_dir / name, wall, rc))
    (out / "e2e.json").write_text(json.dumps(rows, indent=1))
    (out / "e2e.md").write_text(table(rows) + "\n")
    with tarfile.open(out / "e2e_runs.tar.gz", "w:gz") as tar:
        for name, *_ in procs:
            tar.add(runs_dir / f"{name}.launcher.txt", arcname=f"{name}/launcher.txt")
            rd = RunDir(runs_dir / name)
            for sub in (rd.metrics("trainer").parent, rd.logs, rd.config("trainer").parent):
                if sub.is_dir():
                    tar.add(sub, arcname=f"{name}/{sub.name}")
    print(table(rows), flush=True)
    for name, *_ in procs:
        tail = (runs_dir / f"{name}.launcher.txt").read_text().splitlines()[-6:]
        print(f"--- {name}:\n" + "\n".join(tail), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
