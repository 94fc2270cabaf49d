"""`python -m primejax.orchestrator --config configs/x.py [--config.KEY=VALUE ...]`

Runs the orchestrator of one run for steps 1..run.max_steps (or from the checkpoint named by
run.resume_step): samples rollouts from the inference server, scores them, writes rollouts/step_N/ for the
trainer and keeps the server on the newest broadcast weights.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import TYPE_CHECKING

from primejax.config.cli import parse_config, run_main
from primejax.contracts.rundir import write_resolved_config
from primejax.launcher.preflight import preflight_entrypoint

if TYPE_CHECKING:
    from primejax.config import Config


async def run_orchestrator(cfg: Config) -> list[dict[str, float]]:
    """The orchestrator process's work: client, tokenizer, monitor and resume around `Orchestrator`."""
    from primejax.contracts.secret import read_token
    from primejax.inference.routed_experts import RoutingShape
    from primejax.orchestrator.loop import Orchestrator
    from primejax.orchestrator.run import model_vocab_size, policy_client
    from primejax.rendering.renderer import load_tokenizer
    from primejax.transports.weights.registry import follower_for
    from primejax.utils.monitor import Monitor

    root = cfg.run_dir
    client = policy_client(
        cfg.orchestrator.client, cfg.inference, model_vocab_size(cfg.model.path), admin_token=read_token(root)
    )
    monitor = Monitor.from_config(root, "orchestrator", cfg.monitor, cfg.to_dict())
    try:
        await client.wait_ready(cfg.inference.startup_timeout_s)
        orchestrator = Orchestrator(
            cfg.orchestrator,
            client=client,
            tokenizer=load_tokenizer(cfg.model.path),
            run_dir=root,
            seed=cfg.run.seed,
            num_shards=cfg.trainer.distributed.num_processes,
            pad_rows_to_multiple=cfg.trainer.micro_batch_size,
            # An outage may include a server restart (up to its start-up time) after the client's own retries.
            recovery_timeout_s=2 * cfg.inference.startup_timeout_s,
            monitor=monitor,
            routing=RoutingShape.of_model_dir(cfg.model.path) if cfg.orchestrator.routing_replay else None,
            watch=cfg.monitor,
            weights_follower=follower_for(cfg.trainer.broadcast.mode, root),
        )
        orchestrator.resume(cfg.run.resume_step)
        # Start from a known policy: the base model. A server left serving another (or a killed) run's weights
        # is reset; the watcher then loads the newest broadcast of this run, which a resumed trainer re-exports.
        await orchestrator.tracker.resync()
        try:
            return await orchestrator.run(cfg.run.max_steps)
        finally:
            await orchestrator.close()  # the algorithms' frozen-model clients (teacher, frozen sampler)
    finally:
        monitor.close()
        await client.close()


def main() -> int:
    cfg, _ = parse_config(sys.argv[1:], prog="primejax.orchestrator", doc=__doc__.split("\n\n")[1])
    preflight_entrypoint("orchestrator", cfg.model.path)
    # Logs go to stderr: the launcher already sends a child's output to logs/orchestrator.log.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the step lines
    write_resolved_config(cfg.run_dir, "orchestrator", cfg.to_json())
    from primejax.inference.identity import ServerIdentityError
    from primejax.orchestrator.failures import RolloutsFailed
    from primejax.utils.disk import disk_full_line, is_disk_full

    try:
        asyncio.run(run_orchestrator(cfg))  # imports transformers and httpx, deferred to here
    except (
        ServerIdentityError,
        RolloutsFailed,
    ) as e:  # one line says it all (no sample came from an impostor)
        print(f"error: orchestrator: {e}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:
        if not is_disk_full(e):
            raise
        # A batch or checkpoint write that ran out of space: its temp file was removed, nothing half-written.
        print(
            f"error: orchestrator: {disk_full_line(cfg.run_dir, 'a batch or checkpoint')}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
