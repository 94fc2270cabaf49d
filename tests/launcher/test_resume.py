"""What a resume keeps, moves aside and resumes from (files only, no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from primejax.launcher.preflight import PreflightError
from primejax.launcher.resume import common_resume_step, keep_previous_run, set_aside_after


def _trainer_ckpt(root: Path, step: int, complete: bool = True) -> None:
    d = root / "checkpoints" / f"step_{step}" / "trainer"
    (d / "state").mkdir(parents=True)
    (d / "state" / "blob").write_bytes(b"x" * 100)
    if complete:
        (d / "meta.json").write_text(json.dumps({"step": step, "files": {"blob": 100}}))


def _orch_ckpt(root: Path, step: int) -> None:
    d = root / "checkpoints" / f"step_{step}" / "orchestrator"
    d.mkdir(parents=True)
    (d / "state.json").write_text("{}")


def test_common_step_skips_damaged_and_unpaired(tmp_path):
    for s in (1, 2, 3):
        _trainer_ckpt(tmp_path, s)
    _trainer_ckpt(tmp_path, 4, complete=False)
    for s in (1, 2, 4):
        _orch_ckpt(tmp_path, s)
    (tmp_path / "checkpoints" / "step_2" / "trainer" / "state" / "blob").write_bytes(b"x" * 10)  # truncated
    assert common_resume_step(tmp_path, "latest") == 1  # 4: incomplete, 3: no orchestrator, 2: damaged
    assert common_resume_step(tmp_path, "") is None
    assert common_resume_step(tmp_path, "1") == 1
    with pytest.raises(PreflightError, match="run.resume_step"):
        common_resume_step(tmp_path, "3")
    assert common_resume_step(tmp_path / "empty", "latest") is None


def test_set_aside_moves_later_steps_and_drops_temp_writes(tmp_path):
    for kind in ("rollouts", "broadcasts"):
        for s in (1, 2, 3):
            (tmp_path / kind / f"step_{s}").mkdir(parents=True)
    (tmp_path / "rollouts" / ".step_4.abc.tmp").mkdir()
    _trainer_ckpt(tmp_path, 3)
    moved = set_aside_after(tmp_path, 1)
    assert sorted(p.relative_to(p.parents[1]).as_posix() for p in moved) == [
        "broadcasts/step_2",
        "broadcasts/step_3",
        "checkpoints/step_3",
        "rollouts/step_2",
        "rollouts/step_3",
    ]
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_1"]
    assert all(p.exists() for p in moved)  # moved, never deleted


def test_fresh_start_keeps_the_previous_run(tmp_path):
    assert keep_previous_run(tmp_path / "new") is None
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "train.json").write_text("{}")
    assert keep_previous_run(tmp_path) is None  # only this invocation's config: nothing to keep
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "trainer.jsonl").write_text("old\n")
    kept = keep_previous_run(tmp_path)
    assert (kept / "metrics" / "trainer.jsonl").read_text() == "old\n"
    assert not (tmp_path / "metrics").exists() and (tmp_path / "configs" / "train.json").exists()


def test_the_launcher_resumes_by_default_and_fresh_starts_over(tmp_path):
    from types import SimpleNamespace

    from primejax.launcher.resume import RunAlreadyDone, launcher_resume_step, resume_hint

    def run(**kw):
        return SimpleNamespace(**{"resume_step": "", "fresh": False, "max_steps": 20, **kw})

    assert launcher_resume_step(tmp_path, run()) is None  # nothing to resume: a fresh start
    assert "starts over" in resume_hint(tmp_path)
    for s in (10, 20):
        _trainer_ckpt(tmp_path, s)
        _orch_ckpt(tmp_path, s)
    assert launcher_resume_step(tmp_path, run(max_steps=40)) == 20  # a plain rerun resumes the newest pair
    assert launcher_resume_step(tmp_path, run(max_steps=40, resume_step="10")) == 10
    assert launcher_resume_step(tmp_path, run(max_steps=40, fresh=True)) is None
    with pytest.raises(RunAlreadyDone, match="already finished at step 20.*run.fresh=True"):
        launcher_resume_step(tmp_path, run())
    assert resume_hint(tmp_path).startswith("rerun the same command to resume from step 20")
