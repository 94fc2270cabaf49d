"""Inside a SLURM job (the script primejax/cluster/slurm.py writes): start the run's processes with `srun`.

`python -m primejax.cluster.slurm_job --config <run>/configs/train.json` runs in the batch step, on the job's
first node. It
1. expands the job's node list (`scontrol show hostnames $SLURM_JOB_NODELIST`): the first
   `slurm.trainer_nodes` nodes get the trainer ranks (the coordinator of jax.distributed on the first of them),
   the next `slurm.inference_nodes` one inference server each (all addresses come from the node list);
2. settles what to resume from exactly as the local launcher does (newest intact checkpoint pair, later outputs
   set aside: primejax.launcher.resume), so submitting the same script again resumes the run;
3. makes the run's admin secret (`<run>/admin_token`, 0600) and hands it to every task through the
   environment `srun` passes on, never on a command line;
4. starts one `srun` step per role, each with `--kill-on-bad-exit` (one rank that dies ends its step, no
   orphan rank holds a GPU): the inference servers first (waits for their /liveness), then the orchestrator on
   the first trainer node and the trainer ranks;
5. watches: when the trainer and the orchestrator finished it stops the servers and exits 0; when any step
   fails, or on SIGTERM (scancel, the time limit's --signal), it stops every step and exits non-zero.

`python -m primejax.cluster.slurm_job task ROLE --config FILE` is what each srun task runs: it turns SLURM's
task environment (SLURM_PROCID, SLURM_NTASKS) into the trainer's PRIMEJAX_* variables, applies the role's
devices, and replaces itself with `python -m primejax.{trainer,orchestrator,inference}`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from primejax.contracts.rundir import RunDir
from primejax.launcher.preflight import PreflightError
from primejax.utils.sections import replace_keys

if TYPE_CHECKING:
    from primejax.cluster.slurm import SlurmConfig
    from primejax.config import Config

MODULES = {
    "trainer": "primejax.trainer",
    "orchestrator": "primejax.orchestrator",
    "inference": "primejax.inference",
}
POLL_S = 1.0
STOP_GRACE_S = 60.0  # a trainer finishing its in-flight checkpoint on SIGTERM


class JobError(RuntimeError):
    """A job that cannot run as configured (too few nodes, no node list): one line, exit status 2."""


@dataclass(frozen=True)
class Roles:
    """Which node runs what: trainer ranks on `trainer`, one inference server on each of `inference`."""

    trainer: tuple[str, ...]
    inference: tuple[str, ...]

    @property
    def first(self) -> str:
        return self.trainer[0]


def hostnames(nodelist: str) -> list[str]:
    """SLURM's compressed node list ("gpu[01-03],cpu7") as host names, in SLURM's order (scontrol expands it)."""
    if not nodelist.strip():
        raise JobError(
            "SLURM_JOB_NODELIST is empty: run this inside a SLURM job (sbatch the run's job script)"
        )
    proc = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        raise JobError(f"scontrol show hostnames {nodelist!r} failed: {proc.stderr.strip()}")
    return proc.stdout.split()


def split_nodes(hosts: list[str], s: SlurmConfig) -> Roles:
    """The first `trainer_nodes` hosts train; the next `inference_nodes` serve (0: the first trainer node does)."""
    if len(hosts) < s.nodes:
        raise JobError(
            f"the job has {len(hosts)} node(s) ({','.join(hosts)}), the run needs {s.nodes} "
            f"(slurm.trainer_nodes={s.trainer_nodes} + slurm.inference_nodes={s.inference_nodes})"
        )
    trainer = tuple(hosts[: s.trainer_nodes])
    inference = tuple(hosts[s.trainer_nodes : s.nodes]) if s.inference_nodes else trainer[:1]
    return Roles(trainer, inference)


def job_config(cfg: Config, roles: Roles) -> Config:
    """The run's config with the job's addresses: the coordinator, the servers' URLs, how many trainer ranks."""
    s = cfg.slurm
    changes = {
        "trainer.distributed.num_processes": s.trainer_tasks,
        "trainer.distributed.coordinator_address": f"{roles.first}:{s.coordinator_port}",
        "trainer.distributed.process_id": 0,
        "inference.host": "0.0.0.0" if s.inference_nodes else "127.0.0.1",
        "inference.port": s.inference_port,
        # servers beside the orchestrator (inference_nodes=0) bind 127.0.0.1 only: reached there, not by host name
        "orchestrator.client.base_urls": tuple(
            f"http://{h if s.inference_nodes else '127.0.0.1'}:{s.inference_port + i}"
            for h in roles.inference
            for i in range(cfg.inference.replicas)
        ),
    }
    return replace_keys(cfg, changes)


def _local_server(cfg: Config, environ: Mapping[str, str]) -> tuple[int, str]:
    """(port, devices) of inference task SLURM_LOCALID on its node: `inference.replicas` servers per node, on
    consecutive ports, each its share of `inference.devices` (default: the node's `slurm.gpus_per_node` GPUs)."""
    from primejax.launcher.replicas import split_devices

    local = environ.get("SLURM_LOCALID", "0")
    if not local.isdigit() or int(local) >= cfg.inference.replicas:
        raise JobError(
            f"inference task SLURM_LOCALID={local!r}: the config has inference.replicas="
            f"{cfg.inference.replicas} per node"
        )
    devices = cfg.inference.devices
    if not devices and cfg.slurm.gpus_per_node and cfg.slurm.inference_nodes:
        devices = ",".join(str(i) for i in range(cfg.slurm.gpus_per_node))
    try:
        share = split_devices(devices, cfg.inference.replicas)[int(local)]
    except PreflightError as e:
        raise JobError(str(e)) from None
    return cfg.inference.port + int(local), share


def task_command(
    role: str, cfg: Config, config: Path, environ: Mapping[str, str]
) -> tuple[dict[str, str], list[str]]:
    """(environment added, argv) of an srun task of `role`."""
    argv = [sys.executable, "-m", MODULES[role], "--config", str(config)]
    env = task_env(role, cfg, environ)
    if role == "inference":
        port, devices = _local_server(cfg, environ)
        argv.append(f"--config.inference.port={port}")
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices
    return env, argv


def task_env(role: str, cfg: Config, environ: Mapping[str, str]) -> dict[str, str]:
    """What a task of `role` adds to its environment: the trainer's rank from SLURM's task variables, devices."""
    from primejax.utils.devices import accelerator_env

    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if role == "trainer":
        env.update(accelerator_env(cfg.trainer.devices, cfg.trainer.memory_fraction, environ))
        rank, ntasks = environ.get("SLURM_PROCID", ""), environ.get("SLURM_NTASKS", "")
        if not (rank.isdigit() and ntasks.isdigit()):
            raise JobError("a trainer task needs SLURM_PROCID and SLURM_NTASKS (start it with srun)")
        if int(ntasks) != cfg.trainer.distributed.num_processes or int(rank) >= int(ntasks):
            raise JobError(
                f"task {rank} of {ntasks}: the config has "
                f"trainer.distributed.num_processes={cfg.trainer.distributed.num_processes}"
            )
        env.update(
            PRIMEJAX_PROCESS_ID=rank,
            PRIMEJAX_NUM_PROCESSES=ntasks,
            PRIMEJAX_COORDINATOR_ADDRESS=cfg.trainer.distributed.coordinator_address,
        )
    elif role == "orchestrator" and cfg.slurm.gpus_per_node:
        env["CUDA_VISIBLE_DEVICES"] = (
            ""  # it needs no accelerator: no JAX backend of it may take a GPU's memory
        )
    return env


def run_task(role: str, config: Path) -> int:
    """An srun task: set the role's environment, then become `python -m primejax.<role>` (never returns)."""
    from primejax.config import from_json, typed

    cfg = typed(from_json(config.read_text()))
    env, argv = task_command(role, cfg, config, os.environ)
    os.environ.update(env)
    os.execv(sys.executable, argv)
    return 1  # unreachable


class Step:
    """One `srun` step of the job, its output (all tasks, labelled by rank) in `<run>/logs/<role>.log`."""

    def __init__(self, role: str, cfg: Config, config: Path, nodes: tuple[str, ...], tasks_per_node: int):
        self.role = role
        self.log = RunDir(cfg.run_dir).log(role)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            "srun",
            "--overlap",
            "--kill-on-bad-exit=1",
            "--label",
            f"--job-name={role}",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes) * tasks_per_node}",
            f"--ntasks-per-node={tasks_per_node}",
            f"--nodelist={','.join(nodes)}",
            sys.executable,
            "-m",
            "primejax.cluster.slurm_job",
            "task",
            role,
            "--config",
            str(config),
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        """SIGTERM (srun passes it to every task), SIGKILL after STOP_GRACE_S (slurmstepd then ends the tasks)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/liveness", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _wait_servers(cfg: Config, step: Step) -> None:
    deadline = time.monotonic() + cfg.inference.startup_timeout_s
    pending = list(cfg.orchestrator.client.base_urls)
    while pending:
        if step.poll() is not None:
            raise RuntimeError(f"inference exited ({step.poll()}) before answering")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{pending} did not answer /liveness within inference.startup_timeout_s="
                f"{cfg.inference.startup_timeout_s:g}"
            )
        pending = [u for u in pending if not _alive(u)]
        if pending:
            time.sleep(POLL_S)


def run_job(cfg: Config, environ: Mapping[str, str]) -> int:
    """The batch step's work (see the module doc); returns the job's exit status."""
    from primejax.cluster.prepare import prepare
    from primejax.launcher.resume import RunAlreadyDone
    from primejax.launcher.runlock import RunLock

    roles = split_nodes(hostnames(environ.get("SLURM_JOB_NODELIST", "")), cfg.slurm)
    root = cfg.run_dir
    print(
        f"primejax: job {environ.get('SLURM_JOB_ID', '?')}: trainer on {','.join(roles.trainer)} "
        f"({cfg.slurm.trainer_tasks} rank(s)), inference on {','.join(roles.inference)}",
        flush=True,
    )
    steps: list[Step] = []

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        with RunLock(root):
            # The admin secret: made once per job, in the environment srun hands every task (and in the run's
            # 0600 file for a process started by hand), never on a command line.
            cfg, start, configs = prepare(job_config(cfg, roles))
            inference = Step("inference", cfg, configs["inference"], roles.inference, cfg.inference.replicas)
            steps.append(inference)
            _wait_servers(cfg, inference)
            trainer = Step(
                "trainer", cfg, configs["trainer"], roles.trainer, cfg.slurm.trainer_tasks_per_node
            )
            orchestrator = Step("orchestrator", cfg, configs["orchestrator"], roles.trainer[:1], 1)
            steps += [trainer, orchestrator]
            print(f"primejax: run {root} started at step {start} (logs in {RunDir(root).logs})", flush=True)
            while True:
                codes = {s.role: s.poll() for s in steps}
                failed = [s for s in steps if codes[s.role] not in (None, 0)]
                failed += [inference] if codes["inference"] == 0 else []  # a server must not leave early
                if failed:
                    step = failed[0]
                    print(
                        f"primejax: {step.role} failed (exit status {codes[step.role]}); stopping the job. "
                        f"Last lines of {step.log}:\n{step.tail()}",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
                if codes["trainer"] == 0 and codes["orchestrator"] == 0:
                    print(f"primejax: run finished: {cfg.run.max_steps} steps, outputs in {root}", flush=True)
                    return 0
                time.sleep(POLL_S)
    except RunAlreadyDone as done:
        print(f"primejax: {done}", flush=True)
        return 0
    except (PreflightError, JobError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as e:
        print(
            f"primejax: interrupted ({e}); stopping every step; submit the job script again to resume",
            file=sys.stderr,
            flush=True,
        )
        return 143
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop below must not be interrupted
        for step in reversed(steps):
            step.stop()


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["task"]:
        if len(argv) != 4 or argv[1] not in MODULES or argv[2] != "--config":
            print(
                f"usage: python -m primejax.cluster.slurm_job task {{{','.join(MODULES)}}} --config FILE",
                file=sys.stderr,
            )
            return 2
        try:
            return run_task(argv[1], Path(argv[3]))
        except JobError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    from primejax.config.cli import parse_config

    cfg, _ = parse_config(
        argv, prog="primejax.cluster.slurm_job", doc="the batch step of a primejax SLURM job"
    )
    try:
        return run_job(cfg, os.environ)
    except JobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from primejax.config.cli import run_main

    run_main(main)
