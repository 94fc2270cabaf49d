"""The launcher's progress line: one per finished trainer step, read from the trainer's and the orchestrator's
metrics JSONL (`<run>/metrics/{trainer,orchestrator}.jsonl`)."""

from __future__ import annotations

import time
from pathlib import Path

from primejax.contracts.rundir import RunDir
from primejax.utils.monitor import read_jsonl


def progress_line(step: int, max_steps: int, trainer: dict, orch: dict, started: float) -> str:
    width = 20
    done = int(width * step / max(max_steps, 1))
    bar = "#" * done + "." * (width - done)

    def fmt(row: dict, *keys: str, spec: str = ".3f") -> str:
        for key in keys:
            if row.get(key) is not None:
                return format(row[key], spec)
        return "-"

    # an empty batch (every advantage zero, or every rollout errored) trains nothing: a loss of 0 would say it did
    trained = (
        " | empty batch: nothing trained"
        if trainer.get("batch/num_samples") == 0
        else f" | loss {fmt(trainer, 'loss')} | mismatch_kl {fmt(trainer, 'mismatch_kl', spec='.2e')}"
    )
    return (
        f"[{bar}] step {step}/{max_steps}"
        f" | reward {fmt(orch, 'reward/mean')}"
        f"{trained}"
        f" | tok/s {fmt(trainer, 'perf/tokens_per_s', spec='.0f')}"
        f" | wait: trainer {fmt(trainer, 'perf/wait_s', spec='.1f')}s"
        f" orch {fmt(orch, 'time/wait_for_weights', spec='.1f')}s"
        f" | {time.monotonic() - started:.0f}s"
    )


class Progress:
    """Follows the trainer's and orchestrator's metrics JSONL and prints one line per new trainer step."""

    def __init__(self, root: Path, max_steps: int):
        self.root = root
        self.max_steps = max_steps
        self.printed = 0
        self.started = time.monotonic()
        self.started_wall = time.time()  # rows a killed run wrote before a resume are not this run's progress

    def update(self) -> None:
        def rows(name: str) -> dict[int, dict]:
            return {
                r["step"]: r
                for r in read_jsonl(RunDir(self.root).metrics(name))
                if r.get("time", self.started_wall) >= self.started_wall
            }

        trainer_rows, orch_rows = rows("trainer"), rows("orchestrator")
        for step in sorted(s for s in trainer_rows if s > self.printed):
            print(
                progress_line(
                    step, self.max_steps, trainer_rows[step], orch_rows.get(step, {}), self.started
                ),
                flush=True,
            )
            self.printed = step
