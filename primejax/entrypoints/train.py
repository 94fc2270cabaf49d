"""`python -m primejax.train --config configs/x.py [--config.KEY=VALUE ...]`: the user's main command.

Starts the inference server, the orchestrator and the trainer of one run as child processes (see
primejax/launcher/); `--dry_run` resolves, validates, prints and records the config, then loads every environment
and renders one prompt of each (exit 1 when one fails), without starting anything.
"""

from __future__ import annotations

import sys

from absl import flags

from primejax.config.cli import parse_config, run_main
from primejax.contracts.rundir import write_resolved_config

DEFAULT_CONFIG = "configs/demo.py"


def _define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_bool(
        "dry_run",
        False,
        "resolve, validate and print the config, check every environment, then exit",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "launcher",
        "local",
        ["local", "slurm", "k8s"],
        "local: this node; slurm: write the run's sbatch script; k8s: write its Kubernetes manifests "
        "(docs/multinode.md)",
        flag_values=fv,
    )
    flags.DEFINE_bool("submit", False, "with --launcher slurm: also sbatch the job script", flag_values=fv)


def main() -> int:
    cfg, fv = parse_config(
        sys.argv[1:],
        prog="primejax.train",
        doc=__doc__.split("\n\n")[1],
        define_flags=_define_flags,
        default_config_path=DEFAULT_CONFIG,
    )
    if fv["dry_run"].value:
        print(cfg.to_json())
        # Recorded only where no live run is: a dry run must not overwrite a live run's configs/train.json.
        from primejax.launcher.preflight import PreflightError
        from primejax.launcher.runlock import RunLock

        try:
            with RunLock(cfg.run_dir):
                path = write_resolved_config(cfg.run_dir, "train", cfg.to_json())
            print(f"# resolved config written to {path}", file=sys.stderr)
        except PreflightError as e:
            print(f"# resolved config not recorded: {e}", file=sys.stderr)
        from primejax.launcher.envcheck import check_envs  # deferred: loading envs may import verifiers
        from primejax.launcher.preflight import dry_run_model_problem

        def report(ok: bool, line: str) -> None:  # each env's line as soon as it is known
            print(("# " if ok else "error: ") + line, file=sys.stderr, flush=True)

        model_problem = dry_run_model_problem(cfg)  # what the run would refuse, said now
        if model_problem:
            report(False, model_problem)
        return 0 if all(ok for ok, _ in check_envs(cfg, report)) and not model_problem else 1
    if fv["launcher"].value != "local":  # a multi-node run on a scheduler (primejax/cluster/)
        from primejax.cluster import generate

        return generate(cfg, fv["launcher"].value, submit=fv["submit"].value)
    from primejax.launcher.launch import launch  # deferred: the launcher imports process machinery

    return launch(cfg)


if __name__ == "__main__":
    run_main(main)
