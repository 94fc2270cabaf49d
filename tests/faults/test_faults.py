"""Fault injection on real runs (launcher + trainer + orchestrator + vLLM on CPU, tiny model, 4 steps).

Every run uses async_level 0 and a sampling seed per request, so an uninterrupted run is reproducible bit for
bit on CPU: what a step samples depends only on the policy it samples from, never on timing. That is what lets
each test demand the strongest property: after the fault and the recovery the final parameters EQUAL the
reference run's, i.e. every step 1..N was applied exactly once, from the right batch, to the right weights.
Each test also checks that nothing was left running and that the damaged file was never consumed.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from fault_harness import (
    MAX_STEPS,
    assert_params_equal,
    final_params,
    free_port,
    launch,
    trained_steps_since,
    write_config,
)

from primejax.trainer.checkpoint import complete_steps, trainer_ckpt_dir


def _truncate_largest_file(directory: Path) -> Path:
    victim = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    return victim


def test_trainer_killed_mid_step_and_newest_checkpoint_truncated(shared_server, fault_dir, reference):
    """kill -9 of the trainer after an update it never exported, then the newest checkpoint truncated on disk.

    The resume must skip the damaged checkpoint, fall back to the previous intact one, set aside the later
    outputs and redo the lost steps: 0 steps lost, final parameters equal.
    """
    config = write_config(
        fault_dir,
        "trainer_kill",
        shared_server.model_dir,
        base_url=shared_server.base_url,
        max_steps=MAX_STEPS,
    )
    killed = launch(config, faults="trainer.after_update@4=kill:self")
    assert killed.returncode == 1, killed.output[-3000:]
    assert "primejax: trainer failed (exit status -9)" in killed.output
    # Step 3's async save was still pending at the kill: 1 and 2 are complete.
    root = killed.run_dir
    assert complete_steps(root) == [1, 2]
    _truncate_largest_file(trainer_ckpt_dir(root, 2) / "state")

    since = time.time()
    resumed = launch(config, "--config.run.resume_step=latest")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "trainer checkpoint step 2 is damaged" in resumed.output
    assert "resuming from step 1" in resumed.output
    assert "resumed from checkpoint step 1" in resumed.log("trainer")
    assert trained_steps_since(resumed, since) == [2, 3, 4]  # each lost step redone once, none skipped
    assert list((root / "stale").glob("*/checkpoints/step_2")), (
        "the damaged checkpoint is kept aside, not deleted"
    )
    assert_params_equal(final_params(root, MAX_STEPS), reference.params)


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): one more whole run; the default tier kills the trainer mid-step
def test_orchestrator_killed_before_batch_rename_then_corrupted_batch(shared_server, fault_dir, reference):
    """kill -9 of the orchestrator between writing step 3's batch and its rename; on resume, step 3's batch is
    published with flipped bytes (silent corruption: the rename itself succeeds). The trainer must refuse it (sha256 in the manifest), the
    run stop with that one line, and a second resume regenerate the batch: final parameters equal."""
    config = write_config(
        fault_dir, "orch_kill", shared_server.model_dir, base_url=shared_server.base_url, max_steps=MAX_STEPS
    )
    root = config.parent / "runs" / config.stem
    killed = launch(config, faults="orchestrator.before_batch_rename@3=kill:self")
    assert killed.returncode == 1, killed.output[-3000:]
    assert "primejax: orchestrator failed (exit status -9)" in killed.output
    assert not (root / "rollouts" / "step_3").exists()
    assert list((root / "rollouts").glob(".step_3.*.tmp")), "the half-written batch should be in its temp dir"
    assert [r["step"] for r in killed.metrics("trainer")] == [1, 2]
    assert complete_steps(root)[-1] == 2  # the trainer, stopped by SIGTERM, completed its pending checkpoint

    since = time.time()
    corrupted = launch(
        config, "--config.run.resume_step=latest", faults="orchestrator.before_batch_rename@3=corrupt"
    )
    assert corrupted.returncode == 1, corrupted.output[-3000:]
    # Flipped bytes fail the zip CRC or, past it, the manifest's sha256: either way a BatchFormatError line.
    assert re.search(
        r"primejax: trainer failed \(exit status 1\): error: trainer: BatchFormatError: .*"
        r"rank_0\.npz: field '\w+': (sha256 mismatch|unreadable)",
        corrupted.output,
    ), corrupted.output[-3000:]
    assert not list((root / "rollouts").glob(".step_3.*.tmp")), (
        "the resume should drop the dead writer's temp dir"
    )
    assert trained_steps_since(corrupted, since) == []  # the corrupted batch was never trained on
    assert complete_steps(root)[-1] == 2

    since = time.time()
    resumed = launch(config, "--config.run.resume_step=latest")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "resuming from step 2" in resumed.output
    assert trained_steps_since(resumed, since) == [3, 4]
    assert_params_equal(final_params(root, MAX_STEPS), reference.params)


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): two more whole runs
def test_inference_hung_mid_generation(shared_server, fault_dir, reference):
    """The launcher's own vLLM server hangs (SIGSTOP of its whole process group: alive, sockets open, no
    answers) while step 2's requests are in flight. The launcher sees /liveness go silent for
    `hang_timeout_s`, kills and restarts it; the orchestrator's stuck requests fail with the dead sockets and
    it redoes step 2 on the new server: the run finishes in one go with the reference's final parameters."""
    config = write_config(
        fault_dir, "inference_hang", shared_server.model_dir, port=free_port(), max_steps=MAX_STEPS
    )
    result = launch(
        config, "--config.inference.hang_timeout_s=15", faults="orchestrator.generate@2=stop:inference"
    )
    assert result.returncode == 0, result.output[-3000:]
    assert re.search(
        r"inference server failed \(hung: no answer on /liveness for \d+ s\); restarting it \(1/3\)",
        result.output,
    ), result.output[-3000:]
    assert "step 2: inference outage" in result.log("orchestrator")
    assert [r["step"] for r in result.metrics("trainer")] == list(range(1, MAX_STEPS + 1))
    assert_params_equal(final_params(result.run_dir, MAX_STEPS), reference.params)


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): two more whole runs
def test_inference_killed_mid_generation(shared_server, fault_dir, reference):
    """The launcher's own vLLM server is killed (SIGKILL, whole process group) while step 2's requests are in
    flight. The launcher restarts it, the orchestrator redoes step 2 once the server is back (after putting θ_1
    back: a restarted server serves the base model), and the run finishes in one go: final parameters equal."""
    config = write_config(
        fault_dir, "inference_kill", shared_server.model_dir, port=free_port(), max_steps=MAX_STEPS
    )
    result = launch(config, faults="orchestrator.generate@2=kill:inference")
    assert result.returncode == 0, result.output[-3000:]
    assert "inference server failed (exit status -9); restarting it (1/3)" in result.output
    orch_log = result.log("orchestrator")
    assert "step 2: inference outage" in orch_log
    assert "set it back to version 1" in orch_log
    assert [r["step"] for r in result.metrics("trainer")] == list(range(1, MAX_STEPS + 1))
    assert [r["step"] for r in result.metrics("orchestrator")] == list(range(1, MAX_STEPS + 1))
    assert_params_equal(final_params(result.run_dir, MAX_STEPS), reference.params)
