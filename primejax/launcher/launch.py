"""Single-node launcher: one run = (optional SFT warm-up) + inference server + orchestrator + trainer.

Each process is a child in its own process group with its log in `<run>/logs/<process>.log`, and receives the
resolved config as JSON (`<run>/configs/<process>.json`), so a child can also be started by hand on another host
with the same file; `<run>/pids.json` names the live children. The launcher watches: it prints one progress line
per finished trainer step (read from the children's metrics JSONL); it restarts an inference server that died or
stopped answering (`inference.restart_on_failure`, at most `inference.max_restarts` times; the orchestrator
redoes the step it was generating and puts the weights back); on any other child failure, Ctrl-C or SIGTERM
it stops every child by process group, names the one that failed with the tail of its log, and exits non-zero.

Bad input (a model directory without weights or chat template, an environment that does not import, a resume
step with no checkpoint) is caught before anything starts: one line, exit status 2, earlier outputs untouched.
Rerunning the same command resumes both processes from the newest step they both checkpointed
(primejax.launcher.resume; `run.resume_step` names another step, `run.fresh=True` starts over); checkpoints are
written every `trainer.checkpoint.interval` / `orchestrator.checkpoint.interval` steps (10 by default).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from primejax.config import Config
from primejax.contracts.rundir import RunDir, log_path, write_resolved_config
from primejax.envs.judge import JUDGE_MODEL_ENV, JUDGE_URL_ENV
from primejax.inference import identity
from primejax.inference.admin_auth import TOKEN_ENV, write_run_token
from primejax.inference.server import InferenceConfig, ServerSpec, free_port
from primejax.launcher.placement import Placement, PlacementError, node_gpu_count, plan
from primejax.launcher.preflight import (
    PreflightError,
    check_model_dir,
    check_serving,
    check_vllm,
    preflight,
)
from primejax.launcher.replicas import ReplicaSpec, replica_specs
from primejax.launcher.resume import (
    RunAlreadyDone,
    keep_previous_run,
    launcher_resume_step,
    resume_hint,
    set_aside_after,
)
from primejax.launcher.runlock import RunLock, check_port
from primejax.models.settings import ModelSettings
from primejax.utils.devices import accelerator_env
from primejax.utils.io import atomic_write_json
from primejax.utils.monitor import read_jsonl
from primejax.utils.procs import ChildProcess, stop_all
from primejax.utils.sections import replace_key

POLL_S = 0.5
# A server's exit status for arguments it refuses: primejax's inference entry point after ServerSpec.check_model,
# and vLLM's own argument parser. Restarting it with the same arguments cannot help.
REFUSED_EXIT = 2
LIVENESS_POLL_S = 2.0


class ChildFailed(RuntimeError):
    def __init__(self, child: ChildProcess, code: int | None, reason: str = ""):
        self.child = child
        self.code = code
        self.reason = reason or f"exit status {code}"
        super().__init__(f"{child.name} failed ({self.reason})")


def _child_env(devices: str, platform_cpu: bool, memory_fraction: float = 0.0) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if os.environ.get(
        TOKEN_ENV
    ):  # the run's admin secret (launch() sets it): server and orchestrator share it
        env[TOKEN_ENV] = os.environ[TOKEN_ENV]
    env.update(accelerator_env(devices, memory_fraction))  # a node's layout (utils/devices.py): config wins
    if platform_cpu:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _start(
    cfg: Config,
    process: str,
    module: str,
    devices: str = "",
    memory_fraction: float = 0.0,
    hide_gpus: bool = False,
) -> ChildProcess:
    """Start `python -m module` on the resolved config (written to configs/<process>.json); `hide_gpus`: the
    child sees no GPU and runs JAX on the CPU."""
    config_path = write_resolved_config(cfg.run_dir, process, cfg.to_json())
    env = _child_env(devices, hide_gpus or os.environ.get("JAX_PLATFORMS") == "cpu", memory_fraction)
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return ChildProcess(
        process,
        [sys.executable, "-m", module, "--config", str(config_path)],
        log_path(cfg.run_dir, process),
        env=env,
    )


def _place(cfg: Config) -> tuple[Config, Placement]:
    """The node's layout (launcher/placement.py) written into the config the children get."""
    inf, tr = cfg.inference, cfg.trainer
    try:
        p = plan(
            node_gpu_count(),
            tr.devices,
            inf.devices,
            inference_enabled=inf.enabled,
            replicas=inf.replicas,
            tensor_parallel=inf.tensor_parallel_size,
            trainer_memory_fraction=tr.memory_fraction,
            inference_memory_fraction=inf.gpu_memory_utilization,
            visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
    except PlacementError as e:
        raise PreflightError(e.key, str(e).split(": ", 1)[1]) from None
    if not p.node_gpus:
        return cfg, p
    if p.shared and tr.broadcast.mode == "collective":
        raise PreflightError(
            "trainer.broadcast.mode",
            "collective needs the trainer and the server on different "
            "GPUs (NCCL cannot join two processes on one GPU): use filesystem on a shared GPU",
        )
    print(f"primejax: {p.describe()}", flush=True)
    changes: dict[str, object] = {
        "trainer.devices": p.trainer_devices,
        "inference.devices": p.inference_devices,
        "trainer.memory_fraction": p.trainer_memory_fraction,
        "inference.gpu_memory_utilization": p.inference_memory_fraction,
    }
    if tr.broadcast.workers_per_server == 1:  # every tensor-parallel worker of a server receives the update
        changes["trainer.broadcast.workers_per_server"] = inf.tensor_parallel_size
    return _with(cfg, **changes), p


def _wait_healthy(supervisors: list[_InferenceSupervisor], others: list[ChildProcess]) -> None:
    """Block until every server answered /liveness (restarting one that failed, as the run would); raise
    ChildFailed when a server cannot start or another child died meanwhile."""
    while not all(s.liveness.last_ok is not None for s in supervisors):
        for supervisor in supervisors:
            supervisor.check()
        for child in others:
            if child.poll() is not None:
                raise ChildFailed(child, child.poll())
        time.sleep(POLL_S)


def _progress_line(step: int, max_steps: int, trainer: dict, orch: dict, started: float) -> str:
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


class _Progress:
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
                _progress_line(
                    step, self.max_steps, trainer_rows[step], orch_rows.get(step, {}), self.started
                ),
                flush=True,
            )
            self.printed = step


class _Liveness(threading.Thread):
    """Polls GET /liveness in the background; `last_ok` is when the run's own server last answered 200.

    A 200 counts only from a server that answered the identity challenge (primejax.inference.identity) since
    the last failed connection: a port another program took answers /liveness too. `impostor` says why the
    server at the address is not the run's."""

    def __init__(self, base_url: str, secret: str | None = None):
        super().__init__(name="primejax-liveness", daemon=True)
        self.base_url = base_url
        self.url = base_url + "/liveness"
        self.secret = secret
        self.verified = False
        self.impostor = ""
        self.last_ok: float | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    if r.status == 200 and self._identified():
                        self.last_ok = time.monotonic()
            except OSError:  # URLError, HTTPError (503: engine dead), refused, timed out
                self.verified = False
            self._stop_event.wait(LIVENESS_POLL_S)

    def _identified(self) -> bool:
        if self.verified or not self.secret:
            return True
        why = identity.verify_sync(self.base_url, self.secret)
        if why:
            self.impostor = why
            return False
        self.verified = True
        return True

    def stop(self) -> None:
        self._stop_event.set()


class _InferenceSupervisor:
    """Keeps the run's inference server up: restarts it when it exits or hangs, a bounded number of times."""

    def __init__(
        self,
        start: Callable[[], ChildProcess],
        inf: InferenceConfig,
        on_restart: Callable[[ChildProcess], None],
    ):
        """`start` starts the server child; `inf` (the `inference` section) says where it listens and the
        restart policy."""
        self.start_child, self.inf = start, inf
        self.on_restart = on_restart
        self.restarts = 0
        self.child = self._start()

    def _start(self) -> ChildProcess:
        self.child = self.start_child()
        self.started = time.monotonic()
        self.liveness = _Liveness(f"http://{self.inf.host}:{self.inf.port}", os.environ.get(TOKEN_ENV))
        self.liveness.start()
        return self.child

    def _problem(self) -> str | None:
        inf = self.inf
        code = self.child.poll()
        if code is not None:
            return f"exit status {code}"
        last_ok, now = self.liveness.last_ok, time.monotonic()
        if last_ok is None and now - self.started > inf.startup_timeout_s:
            return f"not healthy {inf.startup_timeout_s:.0f} s after start"
        if last_ok is not None and now - last_ok > inf.hang_timeout_s:
            return f"hung: no answer on /liveness for {now - last_ok:.0f} s"
        return None

    def check(self) -> None:
        """Restart the server if it failed (raise ChildFailed when that is not allowed or too many times)."""
        if self.liveness.impostor:  # a restart would bind the same taken port: stop the run, saying why
            raise ChildFailed(self.child, self.child.poll(), self.liveness.impostor)
        problem = self._problem()
        if problem is None:
            return
        inf = self.inf
        if self.child.poll() == REFUSED_EXIT:  # a restart would be refused the same way
            raise ChildFailed(self.child, REFUSED_EXIT, problem + ": the server refused its arguments")
        if not inf.restart_on_failure or self.restarts >= inf.max_restarts:
            limit = "" if not inf.restart_on_failure else f"; {self.restarts} restarts already"
            raise ChildFailed(self.child, self.child.poll(), problem + limit)
        self.restarts += 1
        print(
            f"primejax: inference server failed ({problem}); restarting it "
            f"({self.restarts}/{inf.max_restarts}), log {self.child.log_path}",
            file=sys.stderr,
            flush=True,
        )
        self.stop()
        self._start()
        self.on_restart(self.child)

    def stop(self) -> None:
        self.liveness.stop()
        self.child.stop()


def _watch(
    children: list[ChildProcess],
    until_done: list[ChildProcess],
    progress: _Progress | None,
    supervisors: list[_InferenceSupervisor] = (),
) -> None:
    """Block until every child in `until_done` exits 0; raise ChildFailed as soon as any child fails."""
    while True:
        for supervisor in supervisors:
            supervisor.check()
        for child in children:
            code = child.poll()
            if code is not None and (code != 0 or child not in until_done):
                raise ChildFailed(child, code)
        if progress is not None:
            progress.update()
        if all(c.poll() == 0 for c in until_done):
            return
        time.sleep(POLL_S)


def _error_line(log_text: str) -> str:
    """The line of a log that says what went wrong: our `error: ...` line, else a traceback's last line."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) and " " not in head:
            return ln
    return ""


def _report_failure(err: ChildFailed) -> None:
    tail = err.child.log_tail(40)
    cause = _error_line(tail)
    print(
        f"\nprimejax: {err.child.name} failed ({err.reason}){': ' + cause if cause else ''}; stopping the run.",
        file=sys.stderr,
    )
    print(f"--- last lines of {err.child.log_path} ---", file=sys.stderr)
    print(tail, file=sys.stderr)


def _with(cfg: Config, **changes: object) -> Config:
    """A copy of `cfg` with dotted keys changed (`_with(cfg, **{"model.path": p})`)."""
    for key, value in changes.items():
        cfg = replace_key(cfg, key, value)
    return cfg


def _run_sft_warmup(cfg: Config) -> None:
    """Run `primejax.sft` to completion (its model lands in `<run>/sft/final`)."""
    if cfg.model.lora.rank and not cfg.sft.warmup_lora:  # a full fine-tune warm-up, adapters only in RL
        cfg = _with(cfg, **{"model.lora.rank": 0})
    child = _start(cfg, "sft", "primejax.sft", cfg.trainer.devices, cfg.trainer.memory_fraction)
    print(f"primejax: SFT warm-up ({cfg.sft.steps} steps), log {child.log_path}", flush=True)
    try:
        _watch([child], [child], None)
    finally:
        child.stop()


def _ensure_model(m: ModelSettings) -> None:
    path = Path(m.path)
    if (path / "config.json").exists() or not m.build_tiny.enabled:
        return
    t = m.build_tiny
    print(f"primejax: building a tiny {t.family} model ({t.tokenizer} tokenizer) at {path}", flush=True)
    t.build(path)


def _judge_supervisor(cfg: Config, on_restart: Callable[[ChildProcess], None]) -> _InferenceSupervisor:
    """The LLM judge's own vLLM server (`judge` section, primejax/envs/judge.py): its own port, `max_concurrent`
    sequences at once, no weight updates; kept up like the policy server. Its address goes to the children in
    the environment (JUDGE_URL_ENV / JUDGE_MODEL_ENV), where an env's judge without base_url finds it."""
    j, host = cfg.judge, "127.0.0.1"
    port = check_port(host, j.port, "judge.port") if j.port else free_port(host)
    spec = ServerSpec(model=j.model_path, host=host, port=port, max_model_len=j.max_model_len, dtype=j.dtype,
                      kvcache_space_gb=cfg.inference.kvcache_space_gb, devices=j.devices or cfg.inference.devices,
                      gpu_memory_utilization=j.gpu_memory_utilization, seed=cfg.run.seed, weight_transfer=False,
                      extra_args=("--max-num-seqs", str(j.max_concurrent)), admin_token=os.environ[TOKEN_ENV])  # fmt: skip
    argv = spec.argv()
    os.environ[JUDGE_URL_ENV] = spec.base_url
    os.environ[JUDGE_MODEL_ENV] = argv[argv.index("--model") + 1]  # the name vLLM serves it under
    inf = replace(cfg.inference, host=host, port=port, startup_timeout_s=j.startup_timeout_s)
    return _InferenceSupervisor(
        lambda: ChildProcess("judge", argv, log_path(cfg.run_dir, "judge"), env=spec.environ()),
        inf,
        on_restart,
    )


def _write_pids(root: Path, children: list[ChildProcess]) -> None:
    atomic_write_json(RunDir(root).pids_file, {"launcher": os.getpid(), **{c.name: c.pid for c in children}})


def _prepare(cfg: Config) -> tuple[Config, int]:
    """Check the input, settle what to resume from, run the SFT warm-up; return the RL config and its start step.

    Everything that can reject the run happens before anything in the run directory is moved or written.
    """
    root = cfg.run_dir
    resume = launcher_resume_step(root, cfg.run)
    _ensure_model(cfg.model)
    sft_final = RunDir(root).sft_final
    use_sft = cfg.sft.steps > 0
    reuse_sft = use_sft and resume is not None
    preflight(
        cfg.orchestrator.envs,
        sft_final if reuse_sft else cfg.model.path,
        cfg.inference.max_model_len if cfg.inference.enabled else 0,
    )
    if cfg.inference.enabled:
        check_serving(cfg.inference, cfg.model.path)
    if cfg.judge.enabled:  # its own server (_judge_supervisor) would fail to start, max_restarts times
        check_model_dir(cfg.judge.model_path, key="judge.model_path")
    if resume is None:
        if cfg.run.resume_step and not cfg.run.fresh:
            print(f"primejax: no checkpoint in {root} to resume from: starting at step 0", flush=True)
        kept = keep_previous_run(root)
        if kept is not None:
            print(f"primejax: {root} held an earlier run: kept under {kept}", flush=True)
    else:
        moved = set_aside_after(root, resume)
        print(
            f"primejax: resuming from step {resume}"
            + (f" ({len(moved)} outputs of later steps moved to {moved[0].parents[1]})" if moved else "")
            + "; --config.run.fresh=True starts over",
            flush=True,
        )
    changes: dict[str, object] = {"run.resume_step": "" if resume is None else str(resume)}
    if use_sft:
        if not reuse_sft:  # SFT on resume would redo work and change the policy the checkpoints continue
            _run_sft_warmup(cfg)
        changes.update({"model.path": str(sft_final), "model.build_tiny.enabled": False})
    return _with(cfg, **changes), resume or 0


def launch(cfg: Config) -> int:
    """The launcher's work (entry: `python -m primejax.train`): run the whole job; returns the exit status."""
    root = cfg.run_dir
    children: list[ChildProcess] = []
    supervisors: list[_InferenceSupervisor] = []
    replicas: list[ReplicaSpec] = []

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, on_signal)
    # also when started in the background (`nohup ... &`), where the shell leaves SIGINT ignored
    previous_int = signal.signal(signal.SIGINT, on_signal)
    interrupted = False
    lock = RunLock(root)
    try:
        # Before anything is moved or started: no other live run in this directory, a port the server can have.
        lock.acquire()
        cfg, placement = _place(cfg)
        if cfg.inference.enabled:
            check_vllm()
            replicas = replica_specs(cfg.inference)  # one per server, ports checked (port 0: free ones)
            if replicas[0].port != cfg.inference.port:
                cfg = _with(cfg, **{"inference.port": replicas[0].port})
            if len(replicas) > 1 and not cfg.orchestrator.client.base_urls:
                cfg = _with(cfg, **{"orchestrator.client.base_urls": tuple(r.url for r in replicas)})
        # Only now (this launcher holds the run): a refused second launcher leaves the live run's record alone.
        write_resolved_config(root, "train", cfg.to_json())
        cfg, start_step = _prepare(cfg)
        for replica in replicas:  # again: the SFT warm-up may have taken minutes, and ports are shared
            check_port(replica.host, replica.port)
        root.mkdir(parents=True, exist_ok=True)
        # A fresh admin secret per run ($PRIMEJAX_ADMIN_TOKEN when set: multi-node), in the environment of the
        # children only, never in a config or a log.
        os.environ[TOKEN_ENV] = write_run_token(root)

        def start_trainer() -> ChildProcess:
            return _start(
                cfg, "trainer", "primejax.trainer", cfg.trainer.devices, cfg.trainer.memory_fraction
            )

        def on_restart(new: ChildProcess) -> None:
            children[:] = [c for c in children if c.name != new.name] + [new]
            _write_pids(root, children)

        if cfg.judge.enabled:  # up before the orchestrator: its envs' first scores ask the judge
            supervisors.append(_judge_supervisor(cfg, on_restart))
            children.append(supervisors[-1].child)
            print(f"primejax: judge server starting (log {supervisors[-1].child.log_path})", flush=True)
            _wait_healthy(supervisors, [])
        # The orchestrator needs no accelerator: it sees none (no JAX backend of it may take a GPU's memory).
        orchestrator = _start(cfg, "orchestrator", "primejax.orchestrator", hide_gpus=placement.node_gpus > 0)
        trainer = None if placement.shared else start_trainer()
        children += [c for c in (trainer, orchestrator) if c is not None]
        for replica in replicas:
            replica_cfg = _with(cfg, **{"inference.port": replica.port, "inference.devices": replica.devices})

            def start_server(rl_cfg: Config = replica_cfg, name: str = replica.name) -> ChildProcess:
                return _start(rl_cfg, name, "primejax.inference", devices=rl_cfg.inference.devices)

            supervisor = _InferenceSupervisor(start_server, replica_cfg.inference, on_restart)
            supervisors.append(supervisor)
            children.insert(len(supervisors) - 1, supervisor.child)
        if (
            trainer is None
        ):  # a GPU shared with the server: the trainer allocates once vLLM has profiled the card
            t_wait = time.monotonic()
            _wait_healthy(supervisors, [orchestrator])
            print(
                f"primejax: inference healthy after {time.monotonic() - t_wait:.0f} s; starting the trainer on the "
                "shared GPU",
                flush=True,
            )
            trainer = start_trainer()
            children.insert(0, trainer)
        _write_pids(root, children)
        print(f"primejax: run {root} started (logs in {RunDir(root).logs})", flush=True)
        for child in children:
            print(f"  {child.name:<13} pid {child.pid}  log {child.log_path}", flush=True)
        progress = _Progress(root, cfg.run.max_steps)
        progress.printed = start_step
        served = {s.child.name for s in supervisors}
        watched = [c for c in children if c.name not in served]  # the supervisors own the servers
        _watch(watched, [trainer, orchestrator], progress, supervisors)
        print(f"primejax: run finished: {cfg.run.max_steps} steps, outputs in {root}", flush=True)
        return 0
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ChildFailed as err:
        _report_failure(err)
        return 1
    except RunAlreadyDone as done:
        print(f"primejax: {done}", flush=True)
        return 0
    except KeyboardInterrupt as err:
        print(f"\nprimejax: interrupted ({str(err) or 'SIGINT'}); stopping all processes.", file=sys.stderr)
        interrupted = True
        return 130
    finally:
        for supervisor in supervisors:
            supervisor.liveness.stop()
        stop_all(children)
        if interrupted:  # after the children stopped: the trainer finishes an in-flight checkpoint on SIGTERM
            print(f"primejax: {resume_hint(root, cfg.run.max_steps)}", file=sys.stderr, flush=True)
        lock.release()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
