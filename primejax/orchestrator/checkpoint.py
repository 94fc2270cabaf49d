"""Orchestrator checkpoints: `checkpoints/step_N/orchestrator/state.json` (progress, RNG, buffer), JSON only,
plus `<name>.jsonl` record files next to it (the difficulty pools: `easy_examples.jsonl`, `hard_examples.jsonl`).

The trainer owns `checkpoints/step_N/trainer/`; each side writes its own subdirectory atomically and prunes
only its own, so either can be restarted alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from primejax.contracts.rundir import RunDir, checkpoint_dir, step_dirs
from primejax.utils.io import atomic_dir

PROCESS = "orchestrator"
STATE_FILE = "state.json"


def saved_steps(run_dir: str | Path) -> list[int]:
    return [s for s, p in step_dirs(RunDir(run_dir).checkpoints()) if (p / PROCESS / STATE_FILE).is_file()]


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    keep: int,
    records: dict[str, list[dict[str, Any]]] | None = None,
) -> Path:
    """Write the state of the orchestrator after `step` (and each `records[name]` as `name.jsonl`, one JSON
    object a line) and keep only the newest `keep` checkpoints."""
    path = checkpoint_dir(run_dir, step, PROCESS)
    with atomic_dir(path, overwrite=True) as tmp:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}))
        for name, rows in (records or {}).items():
            (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Prune only once the new checkpoint reads back (a write that failed raised above and pruned nothing).
    json.loads((path / STATE_FILE).read_text())
    if keep > 0:
        for old in saved_steps(run_dir)[:-keep]:
            shutil.rmtree(checkpoint_dir(run_dir, old, PROCESS), ignore_errors=True)
    return path


def load_checkpoint(run_dir: str | Path, resume_step: str) -> dict[str, Any] | None:
    """The state to resume from: `resume_step` is '' (fresh run: None), 'latest', or a step number."""
    if not resume_step:
        return None
    steps = saved_steps(run_dir)
    if resume_step == "latest":
        if not steps:
            return None
        step = steps[-1]
    else:
        step = int(resume_step)
        if step not in steps:
            raise FileNotFoundError(f"no orchestrator checkpoint for step {step} in {run_dir} (have {steps})")
    path = checkpoint_dir(run_dir, step, PROCESS)
    state = json.loads((path / STATE_FILE).read_text())
    state["records"] = {
        f.stem: [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        for f in sorted(path.glob("*.jsonl"))
    }
    return state
