"""Metrics for every process, to each sink the `monitor` section chooses, under the same names.

Each process owns one `Monitor`. Sinks:
- TensorBoard (default): event files under `<run_dir>/tensorboard/<process>/` (tensorboardX);
- JSONL (default): scalars appended to `<run_dir>/metrics/<process>.jsonl` (one JSON object per call:
  {"step": n, "time": t, name: value, ...}), which the launcher's progress line and `tools/plot.py` read, and
  tables appended to `<run_dir>/tables/<process>/<name>.jsonl` (one row object per line, with its step);
- Weights & Biases (`monitor.wandb`): one W&B run per process, grouped by the run's name, written under
  `<run_dir>/wandb/`; `monitor.wandb_mode = "offline"` (the default) needs no network or account
  (`wandb sync <run_dir>/wandb/wandb/offline-run-*` uploads it later). docs/monitoring.md is the user's page.

Each sink records what the run is: the resolved config and the git commit primejax was running from
(TensorBoard text `run/config` and `run/git`, the W&B run's config, and `<run_dir>/metrics/<process>.run.json`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from primejax.contracts.rundir import RunDir
from primejax.utils.io import atomic_write_text
from primejax.utils.sections import ConfigError, Section, option, section

log = logging.getLogger(__name__)
MAX_CELL_CHARS = 20_000  # a table cell or text longer than this is cut (a hostile env can return megabytes)


@section
class MonitorConfig(Section):
    """`monitor`: where each process's metrics go, and what the orchestrator logs beside its step metrics."""

    tensorboard: bool = option(True, "TensorBoard event files under <run>/tensorboard/<process>")
    jsonl: bool = option(True, "scalars appended to <run>/metrics/<process>.jsonl, tables to <run>/tables/")
    wandb: bool = option(False, "Weights & Biases, one run per process under <run>/wandb (pip install wandb)")
    wandb_mode: str = option(
        "offline",
        "offline: files only, no network (wandb sync uploads later); online",
        choices=("offline", "online"),
    )
    wandb_project: str = option("primejax", "W&B project")
    wandb_entity: str = option("", "W&B entity (team or user); '' = the account's default")
    server_metrics: bool = option(True, "log the inference servers' own /metrics per step (server/<i>/*)")
    server_poll_s: float = option(
        2.0, "how often the servers' /metrics are read within a step (0 = only at each step's end)", ge=0.0
    )
    timeline: bool = option(
        True,
        "a Chrome/Perfetto trace per step at <run>/timeline/step_N.json (requests, "
        "env and tool work, waits, weight updates)",
    )
    timeline_image_every: int = option(
        10,
        "every N steps, that step's timeline drawn as the image `timeline` in "
        "TensorBoard and W&B (needs matplotlib); 0 = never",
        ge=0,
    )
    samples_per_env: int = option(
        2,
        "sample rollouts logged per env and step (prompt, completion, reward, advantage); 0 = none",
        ge=0,
        le=64,
    )
    sample_chars: int = option(
        2000, "characters kept of each sample's prompt and completion", gt=0, le=MAX_CELL_CHARS
    )

    def check(self) -> None:
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "wandb", "needs the wandb package: pip install 'primejax[wandb]' (or set monitor.wandb=False)"
            )


def _to_float(value: Any) -> float:
    return float(np.asarray(value).item())


def _cut(text: Any, limit: int = MAX_CELL_CHARS) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"


def git_info(path: str | Path | None = None) -> dict[str, Any]:
    """The git commit of the checkout `path` (default: primejax's own source) and whether it has uncommitted
    changes; {} where it is not a git checkout or git is missing."""
    where = str(path or Path(__file__).resolve().parent)
    try:
        commit = subprocess.run(
            ["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "dirty": bool(dirty)}


class _Wandb:
    """The W&B sink: one run per process (name `<run>/<process>`, group `<run>`), console capture off."""

    def __init__(self, cfg: MonitorConfig, run_dir: Path, process: str, config: Mapping[str, Any]):
        import wandb  # deferred: optional, and slow to import

        self._wandb = wandb
        directory = RunDir(run_dir).wandb
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity or None,
            mode=cfg.wandb_mode,
            dir=str(directory),
            group=run_dir.name,
            name=f"{run_dir.name}/{process}",
            job_type=process,
            config=dict(config),
            settings=wandb.Settings(console="off", silent=True),  # the process's log stays ours
        )

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        self.run.log(dict(values), step=int(step))

    def histogram(self, step: int, name: str, values: np.ndarray) -> None:
        self.log(step, {name: self._wandb.Histogram(values)})

    def image(self, step: int, name: str, image: np.ndarray) -> None:
        self.log(step, {name: self._wandb.Image(image)})

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.log(step, {name: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])})

    def close(self) -> None:
        self.run.finish()
        # finish() may return before W&B's service has written the run's last records; teardown waits for it,
        # so what close() returns on is on disk (a process exits right after).
        self._wandb.teardown()


def _markdown(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A table as TensorBoard's text plugin renders it well: one block per row, short cells as a line of
    `name: value`, long ones (prompts, completions) as code blocks that keep their newlines."""
    blocks = []
    for row in rows:
        short, long = [], []
        for name, value in zip(columns, row, strict=True):
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
            if "\n" in text or len(text) > 80:
                fenced = text.replace("```", "'''")  # a fence inside the text would end the block early
                long.append(f"**{name}**\n\n```\n{fenced}\n```")
            else:
                short.append(f"**{name}** {text}")
        blocks.append(" · ".join(short) + ("\n\n" + "\n\n".join(long) if long else ""))
    return "\n\n---\n\n".join(blocks)


class Monitor:
    @classmethod
    def from_config(
        cls,
        run_dir: str | Path,
        process: str,
        cfg: MonitorConfig,
        run_config: Mapping[str, Any] | None = None,
    ) -> Monitor:
        return cls(
            run_dir,
            process,
            tensorboard=cfg.tensorboard,
            jsonl=cfg.jsonl,
            wandb=cfg if cfg.wandb else None,
            run_config=run_config,
        )

    def __init__(
        self,
        run_dir: str | Path,
        process: str,
        *,
        tensorboard: bool = True,
        jsonl: bool = True,
        wandb: MonitorConfig | None = None,
        run_config: Mapping[str, Any] | None = None,
    ):
        """`wandb`: the section whose W&B settings to use (None = no W&B); `run_config`: the resolved config,
        recorded by every sink with the git commit."""
        self.run_dir = Path(run_dir)
        self.process = process
        self._writer = None
        self._jsonl = None
        self._wandb: _Wandb | None = None
        self._tables_jsonl = jsonl
        info = {"process": process, "git": git_info(), "config": dict(run_config or {})}
        if tensorboard:
            from tensorboardX import SummaryWriter  # deferred: tensorboardX pulls in protobuf at import

            self._writer = SummaryWriter(logdir=str(RunDir(self.run_dir).tensorboard(process)), flush_secs=10)
            git = info["git"]
            self._writer.add_text(
                "run/git",
                f"commit `{git.get('commit', 'unknown')}`"
                + (" (with uncommitted changes)" if git.get("dirty") else ""),
                0,
            )
            if run_config:
                self._writer.add_text("run/config", f"```\n{json.dumps(info['config'], indent=1)}\n```", 0)
        if jsonl:
            path = RunDir(self.run_dir).metrics(process)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = path.open("a", buffering=1)  # line-buffered: readers see whole lines
            atomic_write_text(RunDir(self.run_dir).run_info(process), json.dumps(info, indent=1, default=str))
        if wandb is not None:
            self._wandb = _Wandb(
                wandb,
                self.run_dir,
                process,
                {
                    **info["config"],
                    "git_commit": info["git"].get("commit", ""),
                    "git_dirty": bool(info["git"].get("dirty")),
                    "process": process,
                },
            )

    @property
    def jsonl_path(self) -> Path:
        return RunDir(self.run_dir).metrics(self.process)

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """Log a dict of scalars at `step` (JAX/NumPy scalars are converted; non-finite values are kept as null)."""
        row: dict[str, Any] = {"step": int(step), "time": time.time()}
        floats: dict[str, float] = {}
        for name, value in values.items():
            v = _to_float(value)
            floats[name] = v
            row[name] = v if math.isfinite(v) else None
            if self._writer is not None:
                self._writer.add_scalar(name, v, int(step))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(step, floats)

    def histogram(self, step: int, name: str, values: Sequence[float] | np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64)
        values = values[np.isfinite(values)]
        if not len(values):
            return
        if self._writer is not None:
            self._writer.add_histogram(name, values, int(step))
        if self._wandb is not None:
            self._wandb.histogram(step, name, values)

    def text(self, step: int, name: str, text: str) -> None:
        text = _cut(text)
        if self._writer is not None:
            self._writer.add_text(name, text, int(step))
        if self._wandb is not None:
            self._wandb.table(step, name, ["text"], [[text]])

    def image(self, step: int, name: str, image: np.ndarray) -> None:
        """An RGB uint8 image [height, width, 3] at `step`: TensorBoard and W&B (JSONL has no images)."""
        if self._writer is not None:
            self._writer.add_image(name, image, int(step), dataformats="HWC")
        if self._wandb is not None:
            self._wandb.image(step, name, image)

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Rows of `columns` at `step`: TensorBoard text (one block per row), a W&B table, and a JSONL line per
        row under <run>/tables/<process>/<name>.jsonl. Text cells longer than MAX_CELL_CHARS are cut."""
        if not rows:
            return
        rows = [
            [v if isinstance(v, (int, float)) and not isinstance(v, bool) else _cut(v) for v in r]
            for r in rows
        ]
        if self._writer is not None:
            self._writer.add_text(name, _markdown(columns, rows), int(step))
        if self._tables_jsonl:
            path = RunDir(self.run_dir).table(self.process, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                for r in rows:
                    cells = {
                        c: (v if not isinstance(v, float) or math.isfinite(v) else None)
                        for c, v in zip(columns, r, strict=True)
                    }
                    f.write(json.dumps({"step": int(step), **cells}) + "\n")
        if self._wandb is not None:
            self._wandb.table(step, name, columns, rows)

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
        if self._wandb is not None:
            wandb, self._wandb = self._wandb, None
            try:
                wandb.close()
            except Exception as e:  # noqa: BLE001 - the run's own results are written; W&B's upload is not ours
                log.warning("closing the W&B run failed: %s", e)

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
