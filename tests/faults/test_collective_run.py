"""A whole run in collective mode (`trainer.broadcast.mode = "collective"`) against the shared vLLM server.

Same seed and config as the fault suite's uninterrupted reference run (filesystem mode, async_level 0, seeded
sampling, fp32 weights on both sides), so the strongest property holds: what each step samples depends only
on the policy, hence a run whose weights travel through vLLM's weight-transfer engine must end with the SAME
parameters as the filesystem run, bit for bit, and sample on-policy (mismatch KL ~0) at every step.
"""

from __future__ import annotations

import pytest
from fault_harness import MAX_STEPS, assert_params_equal, final_params, launch, write_config


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): two whole runs; the collective path alone: tests/transfer
def test_collective_run_equals_filesystem_run(shared_server, fault_dir, reference):
    config = write_config(
        fault_dir, "collective", shared_server.model_dir, base_url=shared_server.base_url, max_steps=MAX_STEPS
    )
    result = launch(config, "--config.trainer.broadcast.mode=collective")
    assert result.returncode == 0, result.output[-3000:]
    trainer, orch = result.metrics("trainer"), result.metrics("orchestrator")
    assert [r["step"] for r in trainer] == list(range(1, MAX_STEPS + 1))
    # async_level 0: steps 1..MAX_STEPS-1 are sent (the orchestrator's last step samples θ_{MAX_STEPS-1}).
    sent = [r["step"] for r in trainer if "transfer/seconds" in r]
    assert sent == list(range(1, MAX_STEPS)), trainer
    assert (
        orch[-1]["weights/collective_updates"] == MAX_STEPS - 1 and orch[-1]["weights/failed_transfers"] == 0
    )
    assert "weights sent collectively" in result.log("trainer")
    # Every step sampled the policy the trainer held (fp32 on both sides): trainer/vLLM mismatch ~0.
    assert max(r["mismatch_kl"] for r in trainer) <= 1e-6, [r["mismatch_kl"] for r in trainer]
    assert_params_equal(final_params(result.run_dir, MAX_STEPS), reference.params)
