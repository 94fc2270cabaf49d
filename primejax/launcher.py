"""Single-node launcher: one run = (optional SFT warm-up) + inference server + orchestrator + trainer.

Each process is a child in its own process group with its log in `<run>/logs/<process>.log`, and receives the
resolved config as JSON (`<run>/configs/<process>.json`), so a child can also be started by hand on another host
with the same file. The launcher only watches: it prints one progress line per finished trainer step (read from
the children's metrics JSONL), and on any child failure, Ctrl-C or SIGTERM it stops every child by process group,
names the one that failed with the tail of its log, and exits non-zero.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from ml_collections import ConfigDict

from primejax.config import to_json
from primejax.monitor import read_jsonl
from primejax.rundir import log_path, run_dir
from primejax.utils.io import atomic_write_text
from primejax.utils.procs import ChildProcess

POLL_S = 0.5


class ChildFailed(RuntimeError):
    def __init__(self, child: ChildProcess, code: int | None):
        self.child = child
        self.code = code
        super().__init__(f"{child.name} exited with status {code}")


def _write_child_config(cfg: ConfigDict, process: str) -> Path:
    path = run_dir(cfg) / "configs" / f"{process}.json"
    atomic_write_text(path, to_json(cfg))
    return path


def _child_env(devices: str, platform_cpu: bool) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices
    if platform_cpu:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _start(cfg: ConfigDict, process: str, module: str, devices: str = "") -> ChildProcess:
    config_path = _write_child_config(cfg, process)
    return ChildProcess(
        process,
        [sys.executable, "-m", module, "--config", str(config_path)],
        log_path(run_dir(cfg), process),
        env=_child_env(devices, platform_cpu=os.environ.get("JAX_PLATFORMS") == "cpu"),
    )


def _progress_line(step: int, max_steps: int, trainer: dict, orch: dict, started: float) -> str:
    width = 20
    done = int(width * step / max(max_steps, 1))
    bar = "#" * done + "." * (width - done)

    def fmt(row: dict, *keys: str, spec: str = ".3f") -> str:
        for key in keys:
            if row.get(key) is not None:
                return format(row[key], spec)
        return "-"

    return (
        f"[{bar}] step {step}/{max_steps}"
        f" | reward {fmt(orch, 'reward/mean')}"
        f" | loss {fmt(trainer, 'loss')}"
        f" | mismatch_kl {fmt(trainer, 'mismatch_kl', spec='.2e')}"
        f" | tok/s {fmt(trainer, 'perf/tokens_per_s', spec='.0f')}"
        f" | wait: trainer {fmt(trainer, 'perf/wait_s', spec='.1f')}s"
        f" orch {fmt(orch, 'time/wait_for_weights', spec='.1f')}s"
        f" | {time.monotonic() - started:.0f}s"
    )


class _Progress:
    """Follows the trainer's and orchestrator's metrics JSONL and prints one line per new trainer step."""

    def __init__(self, root: Path, max_steps: int):
        self.root = root
        self.max_steps = max_steps
        self.printed = 0
        self.started = time.monotonic()

    def update(self) -> None:
        trainer_rows = {r["step"]: r for r in read_jsonl(self.root / "metrics" / "trainer.jsonl")}
        orch_rows = {r["step"]: r for r in read_jsonl(self.root / "metrics" / "orchestrator.jsonl")}
        for step in sorted(s for s in trainer_rows if s > self.printed):
            print(_progress_line(step, self.max_steps, trainer_rows[step], orch_rows.get(step, {}), self.started),
                  flush=True)
            self.printed = step


def _watch(children: list[ChildProcess], until_done: list[ChildProcess], progress: _Progress | None) -> None:
    """Block until every child in `until_done` exits 0; raise ChildFailed as soon as any child fails."""
    while True:
        for child in children:
            code = child.poll()
            if code is not None and (code != 0 or child not in until_done):
                raise ChildFailed(child, code)
        if progress is not None:
            progress.update()
        if all(c.poll() == 0 for c in until_done):
            return
        time.sleep(POLL_S)


def _report_failure(err: ChildFailed) -> None:
    print(f"\nprimejax: {err.child.name} failed (exit status {err.code}); stopping the run.", file=sys.stderr)
    print(f"--- last lines of {err.child.log_path} ---", file=sys.stderr)
    print(err.child.log_tail(40), file=sys.stderr)


def _run_sft_warmup(cfg: ConfigDict) -> ConfigDict:
    """Run `primejax.sft` to completion and return the RL config pointed at its exported model."""
    child = _start(cfg, "sft", "primejax.sft", devices=cfg.trainer.devices)
    print(f"primejax: SFT warm-up ({cfg.sft.steps} steps), log {child.log_path}", flush=True)
    try:
        _watch([child], [child], None)
    finally:
        child.stop()
    rl = ConfigDict(cfg.to_dict())  # unlocked copy: only model.path changes
    rl.model.path = str(run_dir(cfg) / "sft" / "final")
    rl.model.build_tiny.enabled = False
    rl.lock()
    return rl


def _ensure_model(cfg: ConfigDict) -> None:
    path = Path(cfg.model.path)
    if (path / "config.json").exists() or not cfg.model.build_tiny.enabled:
        return
    from primejax.models.tiny import build_tiny_model

    t = cfg.model.build_tiny
    print(f"primejax: building a tiny {t.family} model at {path}", flush=True)
    build_tiny_model(
        path, family=t.family, tied=t.tied, hidden_size=t.hidden_size, num_layers=t.num_layers,
        num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
        intermediate_size=t.intermediate_size, seed=t.seed,
    )


def launch(cfg: ConfigDict) -> int:
    """Run the whole job; returns the process exit status."""
    root = run_dir(cfg)
    root.mkdir(parents=True, exist_ok=True)
    children: list[ChildProcess] = []

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        _ensure_model(cfg)
        if cfg.sft.steps > 0 and cfg.run.resume_step == "":
            cfg = _run_sft_warmup(cfg)
        elif cfg.sft.steps > 0:
            cfg = ConfigDict(cfg.to_dict())
            cfg.model.path = str(root / "sft" / "final")
            cfg.lock()
        if cfg.inference.enabled:
            children.append(_start(cfg, "inference", "primejax.inference", devices=cfg.inference.devices))
        trainer = _start(cfg, "trainer", "primejax.trainer", devices=cfg.trainer.devices)
        orchestrator = _start(cfg, "orchestrator", "primejax.orchestrator")
        children += [trainer, orchestrator]
        print(f"primejax: run {root} started (logs in {root / 'logs'})", flush=True)
        for child in children:
            print(f"  {child.name:<13} pid {child.pid}  log {child.log_path}", flush=True)
        _watch(children, [trainer, orchestrator], _Progress(root, cfg.run.max_steps))
        print(f"primejax: run finished: {cfg.run.max_steps} steps, outputs in {root}", flush=True)
        return 0
    except ChildFailed as err:
        _report_failure(err)
        return 1
    except KeyboardInterrupt as err:
        print(f"\nprimejax: interrupted ({err or 'SIGINT'}); stopping all processes.", file=sys.stderr)
        return 130
    finally:
        for child in reversed(children):
            child.stop()
        signal.signal(signal.SIGTERM, previous)
