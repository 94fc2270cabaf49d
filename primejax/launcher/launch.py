"""Single-node launcher: one run = (optional SFT warm-up) + inference server + orchestrator + trainer.

Each process is a child in its own process group with its log in `<run>/logs/<process>.log`, and receives the
resolved config as JSON (`<run>/configs/<process>.json`), so a child can also be started by hand on another host
with the same file; `<run>/pids.json` names the live children (launcher/children.py). The launcher watches
(launcher/supervisor.py): it prints one progress line per finished trainer step (launcher/progress.py); it
restarts an inference server that died or stopped answering (`inference.restart_on_failure`, at most
`inference.max_restarts` times; the orchestrator redoes the step it was generating and puts the weights back); on
any other child failure, Ctrl-C or SIGTERM it stops every child by process group, names the one that failed with
the tail of its log, and exits non-zero.

Bad input (a model directory without weights or chat template, an environment that does not import, a resume
step with no checkpoint) is caught before anything starts (launcher/prepare.py): one line, exit status 2,
earlier outputs untouched. Rerunning the same command resumes both processes from the newest step they both
checkpointed (primejax.launcher.resume; `run.resume_step` names another step, `run.fresh=True` starts over);
checkpoints are written every `trainer.checkpoint.interval` / `orchestrator.checkpoint.interval` steps (10 by
default).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace

from primejax.config import Config
from primejax.contracts.rundir import RunDir, log_path, write_resolved_config
from primejax.envs.judge import JUDGE_MODEL_ENV, JUDGE_URL_ENV
from primejax.inference.admin_auth import TOKEN_ENV, write_run_token
from primejax.inference.server import ServerSpec, free_port
from primejax.launcher.children import start_child, write_pids
from primejax.launcher.placement import place
from primejax.launcher.preflight import PreflightError, check_vllm
from primejax.launcher.prepare import prepare_run
from primejax.launcher.progress import Progress
from primejax.launcher.replicas import ReplicaSpec, replica_specs
from primejax.launcher.resume import RunAlreadyDone, resume_hint
from primejax.launcher.runlock import RunLock, check_port
from primejax.launcher.supervisor import (
    ChildFailed,
    InferenceSupervisor,
    report_failure,
    wait_healthy,
    watch,
)
from primejax.utils.procs import ChildProcess, stop_all
from primejax.utils.sections import replace_keys


def _judge_supervisor(cfg: Config, on_restart: Callable[[ChildProcess], None]) -> InferenceSupervisor:
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
    return InferenceSupervisor(
        lambda: ChildProcess("judge", argv, log_path(cfg.run_dir, "judge"), env=spec.environ()),
        inf,
        on_restart,
    )


def launch(cfg: Config) -> int:
    """The launcher's work (entry: `python -m primejax.train`): run the whole job; returns the exit status."""
    root = cfg.run_dir
    children: list[ChildProcess] = []
    supervisors: list[InferenceSupervisor] = []
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
        cfg, placement = place(cfg)
        if cfg.inference.enabled:
            # Before the record: check_serving in prepare_run checks the release again, for a scheduler's job
            # (primejax/cluster/prepare.py), which has no step before it.
            check_vllm()
            replicas = replica_specs(cfg.inference)  # one per server, ports checked (port 0: free ones)
            if replicas[0].port != cfg.inference.port:
                cfg = replace_keys(cfg, {"inference.port": replicas[0].port})
            if len(replicas) > 1 and not cfg.orchestrator.client.base_urls:
                cfg = replace_keys(cfg, {"orchestrator.client.base_urls": tuple(r.url for r in replicas)})
        # Only now (this launcher holds the run): a refused second launcher leaves the live run's record alone.
        write_resolved_config(root, "train", cfg.to_json())
        cfg, start_step = prepare_run(cfg)
        for replica in replicas:  # again: the SFT warm-up may have taken minutes, and ports are shared
            check_port(replica.host, replica.port)
        root.mkdir(parents=True, exist_ok=True)
        # A fresh admin secret per run ($PRIMEJAX_ADMIN_TOKEN when set: multi-node), in the environment of the
        # children only, never in a config or a log.
        os.environ[TOKEN_ENV] = write_run_token(root)

        def start_trainer() -> ChildProcess:
            return start_child(
                cfg, "trainer", "primejax.trainer", cfg.trainer.devices, cfg.trainer.memory_fraction
            )

        def on_restart(new: ChildProcess) -> None:
            children[:] = [c for c in children if c.name != new.name] + [new]
            write_pids(root, children)

        if cfg.judge.enabled:  # up before the orchestrator: its envs' first scores ask the judge
            supervisors.append(_judge_supervisor(cfg, on_restart))
            children.append(supervisors[-1].child)
            print(f"primejax: judge server starting (log {supervisors[-1].child.log_path})", flush=True)
            wait_healthy(supervisors, [])
        # The orchestrator needs no accelerator: it sees none (no JAX backend of it may take a GPU's memory).
        orchestrator = start_child(
            cfg, "orchestrator", "primejax.orchestrator", hide_gpus=placement.node_gpus > 0
        )
        trainer = None if placement.shared else start_trainer()
        children += [c for c in (trainer, orchestrator) if c is not None]
        for replica in replicas:
            replica_cfg = replace_keys(
                cfg, {"inference.port": replica.port, "inference.devices": replica.devices}
            )

            def start_server(rl_cfg: Config = replica_cfg, name: str = replica.name) -> ChildProcess:
                return start_child(rl_cfg, name, "primejax.inference", devices=rl_cfg.inference.devices)

            supervisor = InferenceSupervisor(start_server, replica_cfg.inference, on_restart)
            supervisors.append(supervisor)
            children.insert(len(supervisors) - 1, supervisor.child)
        # a GPU shared with the server: the trainer allocates once vLLM has profiled the card
        if trainer is None:
            t_wait = time.monotonic()
            wait_healthy(supervisors, [orchestrator])
            print(
                f"primejax: inference healthy after {time.monotonic() - t_wait:.0f} s; starting the trainer on the "
                "shared GPU",
                flush=True,
            )
            trainer = start_trainer()
            children.insert(0, trainer)
        write_pids(root, children)
        print(f"primejax: run {root} started (logs in {RunDir(root).logs})", flush=True)
        for child in children:
            print(f"  {child.name:<13} pid {child.pid}  log {child.log_path}", flush=True)
        progress = Progress(root, cfg.run.max_steps)
        progress.printed = start_step
        served = {s.child.name for s in supervisors}
        watched = [c for c in children if c.name not in served]  # the supervisors own the servers
        watch(watched, [trainer, orchestrator], progress, supervisors)
        print(f"primejax: run finished: {cfg.run.max_steps} steps, outputs in {root}", flush=True)
        return 0
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ChildFailed as err:
        report_failure(err)
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
