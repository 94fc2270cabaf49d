"""Fault injection at named points, for the reliability tests (`tests/faults/`). Inert unless asked for.

`PRIMEJAX_FAULTS="trainer.after_update@3=kill:self,orchestrator.before_batch_rename@2=corrupt"` arms: when the
code passes `fault_point("trainer.after_update", 3, ...)` the matching action runs, once per process:

- `kill:self`: SIGKILL this process (a crash that runs no cleanup, like the OOM killer or kill -9);
- `kill:<child>`: SIGKILL the process group of a launcher child named in `<run>/pids.json` (e.g. the server);
- `stop:<child>`: SIGSTOP that process group: a hang (alive, sockets open, nothing answered);
- `corrupt`: flip bytes in the middle of the file passed as `path` (a silently damaged batch);
- `enospc`: raise `OSError(ENOSPC)` there, as a write on a full disk does (where no small disk can be mounted);
- `eio`: raise `OSError(EIO)` there, as a failing disk or network filesystem does.

Real faults do not announce themselves; named points only make the tests hit the exact windows that matter
(between a write and its rename, between an update and its export) instead of racing a timer.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
from pathlib import Path

ENV_VAR = "PRIMEJAX_FAULTS"

log = logging.getLogger("primejax.faults")
_fired: set[str] = set()


def _armed() -> dict[str, str]:
    spec = os.environ.get(ENV_VAR, "")
    faults = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, action = item.partition("=")
        faults[point] = action
    return faults


def fault_point(
    name: str, step: int, *, run_dir: str | Path | None = None, path: str | Path | None = None
) -> None:
    """Run the fault armed for `name@step`, if any (no-op when PRIMEJAX_FAULTS is unset)."""
    if ENV_VAR not in os.environ:
        return
    key = f"{name}@{step}"
    action = _armed().get(key)
    if action is None or key in _fired:
        return
    _fired.add(key)
    log.warning("fault injection: %s -> %s", key, action)
    if action == "kill:self":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.startswith(("kill:", "stop:")):
        from primejax.contracts.rundir import RunDir  # here: armed faults only, the module stays import-light

        pids = json.loads(RunDir(run_dir or ".").pids_file.read_text())
        verb, child = action.split(":", 1)
        os.killpg(int(pids[child]), signal.SIGKILL if verb == "kill" else signal.SIGSTOP)
    elif action in ("enospc", "eio"):
        code = errno.ENOSPC if action == "enospc" else errno.EIO
        raise OSError(code, os.strerror(code), str(path or ""))
    elif action == "corrupt":
        target = Path(path or "")
        with target.open("r+b") as f:
            f.seek(target.stat().st_size // 2)
            chunk = f.read(64)
            f.seek(-len(chunk), os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in chunk))
    else:
        raise ValueError(f"{ENV_VAR}: unknown action {action!r} for {key}")
