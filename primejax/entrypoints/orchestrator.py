"""`python -m primejax.orchestrator --config configs/x.py [--config.KEY=VALUE ...]`

Runs the orchestrator of one run for steps 1..run.max_steps (or from the checkpoint named by
run.resume_step): samples rollouts from the inference server, scores them, writes rollouts/step_N/ for the
trainer and keeps the server on the newest broadcast weights.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from primejax.config.cli import parse_config, run_main
from primejax.contracts.rundir import write_resolved_config
from primejax.launcher.preflight import preflight_entrypoint


def main() -> int:
    cfg, _ = parse_config(sys.argv[1:], prog="primejax.orchestrator", doc=__doc__.split("\n\n")[1])
    preflight_entrypoint("orchestrator", cfg.model.path)
    # Logs go to stderr: the launcher already sends a child's output to logs/orchestrator.log.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the step lines
    write_resolved_config(cfg.run_dir, "orchestrator", cfg.to_json())
    from primejax.inference.identity import ServerIdentityError
    from primejax.orchestrator.failures import RolloutsFailed
    from primejax.orchestrator.run import run_orchestrator  # deferred: pulls in transformers and httpx
    from primejax.utils.disk import disk_full_line, is_disk_full

    try:
        asyncio.run(run_orchestrator(cfg))
    except (ServerIdentityError, RolloutsFailed) as e:  # one line says it all (no sample came from an impostor)
        print(f"error: orchestrator: {e}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:
        if not is_disk_full(e):
            raise
        # A batch or checkpoint write that ran out of space: its temp file was removed, nothing half-written.
        print(f"error: orchestrator: {disk_full_line(cfg.run_dir, 'a batch or checkpoint')}", file=sys.stderr,
              flush=True)
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
