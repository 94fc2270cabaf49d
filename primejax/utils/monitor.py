"""Metrics for every process: TensorBoard event files (tensorboardX) plus a JSONL of the same scalars.

Each process owns one `Monitor`: events under `<run_dir>/tensorboard/<process>/`, scalars appended to
`<run_dir>/metrics/<process>.jsonl` (one JSON object per call: {"step": n, "time": t, name: value, ...}), which the
launcher's progress line and `tools/plot.py` read without TensorBoard.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from primejax.contracts.rundir import RunDir
from primejax.utils.sections import Section, option, section


@section
class MonitorConfig(Section):
    """`monitor`: where each process's metrics go."""

    tensorboard: bool = option(True, "TensorBoard event files under <run>/tensorboard/<process>")
    jsonl: bool = option(True, "scalars appended to <run>/metrics/<process>.jsonl")


def _to_float(value: Any) -> float:
    return float(np.asarray(value).item())


class Monitor:
    @classmethod
    def from_config(cls, run_dir: str | Path, process: str, cfg: MonitorConfig) -> Monitor:
        return cls(run_dir, process, tensorboard=cfg.tensorboard, jsonl=cfg.jsonl)

    def __init__(self, run_dir: str | Path, process: str, *, tensorboard: bool = True, jsonl: bool = True):
        self.run_dir = Path(run_dir)
        self.process = process
        self._writer = None
        self._jsonl = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # deferred: tensorboardX pulls in protobuf at import

            self._writer = SummaryWriter(logdir=str(RunDir(self.run_dir).tensorboard(process)), flush_secs=10)
        if jsonl:
            path = RunDir(self.run_dir).metrics(process)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = path.open("a", buffering=1)  # line-buffered: readers see whole lines

    @property
    def jsonl_path(self) -> Path:
        return RunDir(self.run_dir).metrics(self.process)

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """Log a dict of scalars at `step` (JAX/NumPy scalars are converted; non-finite values are kept as null)."""
        row: dict[str, Any] = {"step": int(step), "time": time.time()}
        for name, value in values.items():
            v = _to_float(value)
            row[name] = v if math.isfinite(v) else None
            if self._writer is not None:
                self._writer.add_scalar(name, v, int(step))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")

    def histogram(self, step: int, name: str, values: Sequence[float] | np.ndarray) -> None:
        if self._writer is not None and len(values):
            self._writer.add_histogram(name, np.asarray(values, dtype=np.float64), int(step))

    def text(self, step: int, name: str, text: str) -> None:
        if self._writer is not None:
            self._writer.add_text(name, text, int(step))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()
        if self._jsonl is not None:
            self._jsonl.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics JSONL, ignoring a torn last line (the writer may be mid-write)."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
