"""`python -m primejax.trainer --config configs/x.py [--config.KEY=VALUE ...]`: the trainer process.

Waits for rollouts/step_N, trains one step on them, exports the weights to broadcasts/step_N, checkpoints
every trainer.checkpoint.interval steps; trainer.fake_data.enabled trains on random rows (benchmarks).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from primejax.config.cli import parse_config, run_main
from primejax.contracts.rundir import write_resolved_config
from primejax.launcher.preflight import preflight_entrypoint
from primejax.utils.devices import (
    accelerator_env,
    check_host_memory,
    host_memory_available,
    local_gpu_count,
    pinned_host_env,
)

if TYPE_CHECKING:
    from primejax.config import Config
    from primejax.trainer.step import TrainState


def offloaded_state_bytes(cfg, devices: int = 0) -> int:
    """Host memory an offloaded run's optimizer state takes: fp32 master + two fp32 moments, 12 B per parameter, or
    8 with the master on the devices (`trainer.optim.offload_master` False), less what `offload_resident_gib` keeps
    on each of the run's `devices` trainer devices."""
    from primejax.models.config import ModelConfig
    from primejax.trainer.offload import host_state_bytes  # imports JAX, does not start a backend

    o = cfg.trainer.optim
    return host_state_bytes(
        ModelConfig.from_model_dir(cfg.model.path).num_params(),
        devices,
        master_on_host=o.offload_master,
        resident_gib=o.offload_resident_gib,
    )


def _pinned_host_env(cfg) -> dict:
    """The pinned-host cap for an offloaded run (utils/devices.py): `offloaded_state_bytes` over every trainer
    device (local GPUs x processes); one line first if this host lacks the memory."""
    from primejax.trainer.loop import distributed_settings  # imports JAX, does not start a backend

    processes = distributed_settings(cfg.trainer.distributed)[
        1
    ]  # PRIMEJAX_NUM_PROCESSES wins, as for the run
    local = local_gpu_count(cfg.trainer.devices, os.environ)
    state = offloaded_state_bytes(cfg, local * processes)
    check_host_memory(state, local, local * processes, host_memory_available())
    return pinned_host_env(state, local * processes, os.environ)


def train(cfg: Config) -> TrainState:
    """The trainer process's work: a `Trainer` from the sections it reads; returns the final state."""
    # deferred: JAX must not initialize before main() has set the accelerator environment
    from primejax.trainer.corrections import CorrectionTable
    from primejax.trainer.loop import Trainer
    from primejax.utils.monitor import Monitor

    root = cfg.run_dir
    root.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        cfg.trainer,
        cfg.model,
        cfg.run,
        async_level=cfg.orchestrator.async_level,
        num_receivers=max(1, len(cfg.orchestrator.client.base_urls))
        * cfg.trainer.broadcast.workers_per_server,
        corrections=CorrectionTable.from_orchestrator(cfg.orchestrator),
    )
    if trainer.rank != 0:  # one writer of the run's metrics
        return trainer.run(None)
    with Monitor.from_config(root, "trainer", cfg.monitor, cfg.to_dict()) as monitor:
        return trainer.run(monitor)


def main() -> int:
    cfg, _ = parse_config(sys.argv[1:], prog="primejax.trainer", doc=__doc__.split("\n\n")[1])
    if cfg.model.path:  # '' = fake-data mode on a random model (trainer.fake_data)
        preflight_entrypoint("trainer", cfg.model.path)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Only the trainer's GPUs, JAX's share of them bounded: before JAX initializes its backends (imports below).
    os.environ.update(accelerator_env(cfg.trainer.devices, cfg.trainer.memory_fraction, os.environ))
    if cfg.trainer.optim.offload and cfg.model.path:
        os.environ.update(_pinned_host_env(cfg))
    from primejax.contracts.batch import BatchFormatError
    from primejax.trainer.checkpoint import CheckpointError
    from primejax.trainer.loop import NonFiniteError, maybe_init_distributed
    from primejax.utils.disk import io_error_line

    maybe_init_distributed(cfg.trainer.distributed)
    write_resolved_config(cfg.run_dir, "trainer", cfg.to_json())
    # SIGTERM (the launcher stopping the run) unwinds like an exception, so the loop's `finally` completes the
    # checkpoint still being saved in the background instead of losing it.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        train(cfg)
    except (BatchFormatError, NonFiniteError, CheckpointError, FileNotFoundError, TimeoutError) as e:
        # Bad data or a stopped run, not a bug: one line the launcher can show, no traceback. Nothing was
        # consumed or written for the failing step, so a resume starts from the last checkpoint.
        print(f"error: trainer: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:
        # A broadcast or batch write that failed (disk full, EIO): its temp files were removed, nothing
        # half-written; one line naming the run's disk, not the cwd's.
        print(f"error: trainer: {io_error_line(e, cfg.run_dir, 'its outputs')}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
