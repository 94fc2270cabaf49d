"""Checks the launcher runs before it starts anything: bad input fails in one line, before any process or file.

Each check names what is wrong and where, so a user sees `error: model.path ...: no config.json` instead of
a child's traceback a minute later (and a run directory half-overwritten by a start that could never work).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from primejax.orchestrator.config import EnvConfig
from primejax.utils.sections import ConfigError


class PreflightError(ConfigError):
    """Bad input found before the run started; printed as one line, exit status 2."""


def check_vllm() -> None:
    """The installed vLLM is one primejax supports (primejax/inference/vllm_compat.py)."""
    from primejax.inference import vllm_compat

    try:
        vllm_compat.check_supported(vllm_compat.installed())
    except ValueError as e:
        raise PreflightError("inference", str(e)) from None


def check_model_dir(
    path: str | Path, *, need_weights: bool = True, key: str = "model.path", need_tokenizer: bool = True
) -> None:
    """An HF model directory: config.json, safetensors weights, a tokenizer with a chat template."""
    path = Path(path)
    if not path.is_dir():
        raise PreflightError(key, f"{str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise PreflightError(key, f"{str(path)!r} has no config.json (not an HF model directory)")
    try:
        hf_config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise PreflightError(key, f"{path / 'config.json'} is not valid JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PreflightError(key, f"{path / 'config.json'} is unreadable ({e})") from None
    if not isinstance(hf_config, dict):
        raise PreflightError(
            key, f"{path / 'config.json'} must hold a JSON object, got {type(hf_config).__name__}"
        )
    if need_weights and not any(path.glob("*.safetensors")):
        raise PreflightError(key, f"{str(path)!r} has no *.safetensors weights")
    if not need_tokenizer:
        return
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise PreflightError(
            key, f"{str(path)!r} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)"
        )
    if not _has_chat_template(path):
        raise PreflightError(
            key,
            f"the tokenizer in {str(path)!r} has no chat template "
            "(chat_template.jinja or tokenizer_config.json's chat_template)",
        )


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, json.JSONDecodeError):
        return False


def check_env_ids(envs: dict[str, EnvConfig]) -> None:
    """Every `orchestrator.envs` id resolves to something importable (without loading any dataset)."""
    from primejax.envs.registry import registered_envs

    builtins = set(registered_envs())
    for name, entry in envs.items():
        env_id = entry.id
        if env_id in builtins:
            continue
        if ":" in env_id or "." in env_id:
            candidates = [env_id.partition(":")[0]]
        else:  # a verifiers taskset: an installed package, or one that ships with verifiers
            module = env_id.replace("-", "_")
            candidates = [module, f"verifiers.v1.tasksets.{module}"]
        if not any(_importable(m) for m in candidates):
            module = candidates[0]
            raise PreflightError(
                f"orchestrator.envs.{name}.id",
                f"{env_id!r} is neither a builtin ({', '.join(sorted(builtins))}) nor an importable "
                f"module ({module!r} not found)",
            )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def preflight_entrypoint(process: str, model_path: str | Path, *, buildable: bool = False) -> None:
    """What a standalone entrypoint reads, checked before it starts (one line, exit 2, no traceback): the
    same model-directory rules as the launcher's, limited to what `process` uses. `buildable`: a missing
    directory is fine, the process builds the tiny model there (model.build_tiny)."""
    if buildable and not (Path(model_path) / "config.json").exists():
        return
    needs = {  # process: (weights, tokenizer with chat template)
        "trainer": (True, False),
        "orchestrator": (False, True),
        "inference": (True, True),
        "sft": (True, True),
        "eval": (True, True),
    }
    weights, tokenizer = needs[process]
    check_model_dir(model_path, need_weights=weights, need_tokenizer=tokenizer)


def preflight_tool(key: str, model_path: str | Path, *, weights: bool, tokenizer: bool = False) -> None:
    """A tool's model-directory argument (`key`: the flag or config key naming it), checked with the launcher's
    rules before the tool imports or loads anything: one line `error: KEY: ...` on stderr, exit status 2."""
    try:
        check_model_dir(model_path, need_weights=weights, need_tokenizer=tokenizer, key=key)
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def preflight(envs: dict[str, EnvConfig], model_path: str | Path) -> None:
    """All checks for an RL run whose policy starts from `model_path`."""
    check_model_dir(model_path)
    check_env_ids(envs)
