"""The launcher's progress line (primejax/launcher/progress.py `progress_line`)."""

from __future__ import annotations

from primejax.launcher.progress import progress_line


def test_an_empty_batch_says_so_instead_of_a_zero_loss():
    """Issue 48: a step whose batch was empty (all advantages zero) printed `loss 0.000 | mismatch_kl 0.00e+00`
    as if it trained."""
    empty = {"loss": 0.0, "mismatch_kl": 0.0, "batch/num_samples": 0.0, "perf/tokens_per_s": 0.0}
    line = progress_line(3, 10, empty, {"reward/mean": 0.0}, started=0.0)
    assert "empty batch: nothing trained" in line and "loss" not in line and "mismatch_kl" not in line
    trained = {**empty, "loss": 0.25, "mismatch_kl": 1e-3, "batch/num_samples": 16.0}
    line = progress_line(4, 10, trained, {"reward/mean": 0.5}, started=0.0)
    assert "loss 0.250 | mismatch_kl 1.00e-03" in line and "empty batch" not in line
