"""`python -m primejax.inference --config configs/x.py [--config.KEY=VALUE ...] [-- VLLM_ARGS...]`

Starts the inference server of a run (stock vLLM OpenAI API server + primejax admin routes) in the
foreground, serving `model.path` with the `inference` config section. Arguments after `--` go to vLLM.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from absl import flags

from primejax.config.cli import parse_config, run_main
from primejax.inference.admin_auth import TOKEN_ENV, server_token
from primejax.inference.server import ServerSpec, exec_server
from primejax.launcher.preflight import preflight_entrypoint


def _define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_bool("dry_run", False, "print the vLLM command and environment, then exit", flag_values=fv)


def served_lora_rank(cfg) -> int:
    """The adapters' rank when the trainer publishes LoRA adapters (the server then starts with LoRA), else 0."""
    return cfg.model.lora.rank if cfg.trainer.broadcast.lora == "adapter" else 0


def main() -> int:
    argv = sys.argv[1:]
    vllm_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, vllm_args = argv[:i], argv[i + 1 :]
    cfg, fv = parse_config(
        argv, prog="primejax.inference", doc=__doc__.split("\n\n")[1], define_flags=_define_flags
    )
    preflight_entrypoint("inference", cfg.model.path, buildable=cfg.model.build_tiny.enabled)
    spec = ServerSpec.from_config(
        cfg.inference,
        cfg.model.path,
        cfg.run.seed,
        run_dir=cfg.run_dir,
        admin_token=server_token(cfg.run_dir),
        lora_rank=served_lora_rank(cfg),
        transport=cfg.trainer.broadcast.mode,
    )
    if fv["dry_run"].value:
        env = spec.environ({})
        env[TOKEN_ENV] = "<hidden>"  # the admin secret is never printed or logged
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(spec.argv() + vllm_args))
        return 0
    if not Path(cfg.model.path).is_dir():
        if not cfg.model.build_tiny.enabled:
            print(f"error: model.path {cfg.model.path!r} is not a directory", file=sys.stderr)
            return 2
        cfg.model.build_tiny.build(cfg.model.path)
    try:
        spec.check_model()  # needs the model directory, built above when asked
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"primejax.inference: serving {cfg.model.path} at {spec.base_url}", file=sys.stderr, flush=True)
    exec_server(spec, vllm_args)
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    run_main(main)
