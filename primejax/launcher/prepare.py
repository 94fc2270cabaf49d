"""What a run needs done before its RL processes start: check the input, settle what to resume from, run the
SFT warm-up. The local launcher (launcher/launch.py) and a scheduler's job (primejax/cluster/prepare.py) both
start with `prepare_run`.

Bad input (a model directory without weights or chat template, an environment that does not import, a resume
step with no checkpoint, what the run's own server would refuse) raises PreflightError before anything in the
run directory is moved or written; a run whose checkpoint already reaches `run.max_steps` raises RunAlreadyDone.
"""

from __future__ import annotations

from pathlib import Path

from primejax.config import Config
from primejax.contracts.rundir import RunDir
from primejax.launcher.children import start_child
from primejax.launcher.preflight import check_model_dir, check_serving, preflight
from primejax.launcher.resume import keep_previous_run, launcher_resume_step, set_aside_after
from primejax.launcher.supervisor import watch
from primejax.models.settings import ModelSettings
from primejax.utils.sections import replace_keys


def _run_sft_warmup(cfg: Config) -> None:
    """Run `primejax.sft` to completion (its model lands in `<run>/sft/final`)."""
    if cfg.model.lora.rank and not cfg.sft.warmup_lora:  # a full fine-tune warm-up, adapters only in RL
        cfg = replace_keys(cfg, {"model.lora.rank": 0})
    child = start_child(cfg, "sft", "primejax.sft", cfg.trainer.devices, cfg.trainer.memory_fraction)
    print(f"primejax: SFT warm-up ({cfg.sft.steps} steps), log {child.log_path}", flush=True)
    try:
        watch([child], [child], None)
    finally:
        child.stop()


def _ensure_model(m: ModelSettings) -> None:
    path = Path(m.path)
    if (path / "config.json").exists() or not m.build_tiny.enabled:
        return
    t = m.build_tiny
    print(f"primejax: building a tiny {t.family} model ({t.tokenizer} tokenizer) at {path}", flush=True)
    t.build(path)


def prepare_run(cfg: Config) -> tuple[Config, int]:
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
    if cfg.judge.enabled:  # its own server (launch.py starts it) would fail to start, max_restarts times
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
    return replace_keys(cfg, changes), resume or 0
