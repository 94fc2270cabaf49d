"""A primejax run's configuration: the sections composed, the user's ConfigDict, and the typed view.

Each component owns its section as a frozen, documented dataclass next to its code (`primejax.trainer.config`,
`primejax.orchestrator.config`, `primejax.inference.server.InferenceConfig`, ...). This module only composes
them: `Config` is the whole tree, `default_config()` writes its defaults as the ml-collections `ConfigDict` that
`configs/*.py` edit and `--config.a.b=v` overrides, and `typed()` reads a ConfigDict back into `Config`, checking
every section's rules and the cross-section ones (`primejax.config.rules`). An entrypoint calls `typed()` once
(through `primejax.config.cli.parse_config`) and hands each component the section it uses.

Resolved configs are written as JSON (`to_json`) and read back with `from_json`, which also converts configs
saved before a key changed (`primejax.config.compat`). How to add a key: docs/configuration.md.
"""

from __future__ import annotations

import json
from typing import Any

from ml_collections import ConfigDict, FieldReference

from primejax.config import compat, rules
from primejax.contracts.cluster import K8sConfig, SlurmConfig
from primejax.contracts.rundir import RunConfig
from primejax.envs.judge import JudgeServerConfig
from primejax.inference.server import InferenceConfig
from primejax.models.settings import ModelSettings
from primejax.orchestrator.config import EnvConfig, OrchestratorConfig
from primejax.sft.data import SftConfig
from primejax.trainer.config import TrainerConfig
from primejax.utils.monitor import MonitorConfig
from primejax.utils.sections import (
    ConfigError,
    Section,
    build,
    describe,
    field_kind,
    option,
    replace_key,
    section,
    sub,
    to_configdict,
    union_types,
)


@section
class Config(Section):
    """The whole configuration of a run."""

    run: RunConfig = sub(RunConfig, "name, output directory, steps, seed, resume")
    model: ModelSettings = sub(ModelSettings, "the policy model")
    trainer: TrainerConfig = sub(TrainerConfig, "the trainer process")
    orchestrator: OrchestratorConfig = sub(OrchestratorConfig, "the orchestrator process")
    inference: InferenceConfig = sub(InferenceConfig, "the inference server")
    judge: JudgeServerConfig = sub(
        JudgeServerConfig, "an LLM judge's own vLLM server, started by the launcher"
    )
    monitor: MonitorConfig = sub(MonitorConfig, "metrics")
    sft: SftConfig = sub(SftConfig, "supervised fine-tuning")
    slurm: SlurmConfig = sub(SlurmConfig, "the SLURM job of `python -m primejax.train --launcher slurm`")
    k8s: K8sConfig = sub(K8sConfig, "the Kubernetes manifests of `python -m primejax.train --launcher k8s`")

    @property
    def run_dir(self):
        return self.run.dir

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def default_config() -> ConfigDict:
    """The full default tree of a run as a ConfigDict. Config files modify a copy of this."""
    return to_configdict(Config())


def env(env_id: str, **args: Any) -> ConfigDict:
    """One `orchestrator.envs` entry, for config files: `c.orchestrator.envs.math = env("arithmetic")`."""
    return to_configdict(EnvConfig(id=env_id, args=args))


_env = env  # the name config files and tests used before


def typed(c: ConfigDict | dict) -> Config:
    """The typed, validated view of a config tree. Raises ConfigError naming the key."""
    cfg = build(Config, c)
    if (
        cfg.orchestrator.checkpoint.interval < 0
    ):  # -1: the trainer's interval (a resume needs a step both saved)
        cfg = replace_key(cfg, "orchestrator.checkpoint.interval", cfg.trainer.checkpoint.interval)
    rules.check(cfg)
    return cfg


def validate(c: ConfigDict) -> ConfigDict:
    """Check a ConfigDict (every section's rules and the cross-section ones); returns it unchanged."""
    typed(c)
    return c


def keys() -> list[tuple[str, Any, str]]:
    """(key, default, doc) of every config key (`--help=keys`)."""
    return describe(Config)


def get(c: ConfigDict, key: str) -> Any:
    node: Any = c
    for part in key.split("."):
        node = node[part]
    return node


def lock(c: ConfigDict) -> ConfigDict:
    """Lock the tree so that setting an unknown key raises, recursively (ConfigDict.lock is recursive)."""
    c.lock()
    return c


def to_json(c: Config | ConfigDict) -> str:
    if isinstance(c, Config):
        return c.to_json()
    return c.to_json_best_effort(indent=2, sort_keys=True)


def from_json(text: str) -> ConfigDict:
    """Rebuild a config written by `to_json`, including ones saved before a key changed (compat.RENAMED).

    Keys are checked against the sections (one line naming an unknown key); values are checked by `typed()`
    once overrides are applied.
    """
    try:
        tree = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("", f"not a JSON config ({e.msg})") from None
    if not isinstance(tree, dict):
        raise ConfigError("", f"not a JSON config (the top level is a {type(tree).__name__}, not an object)")
    try:
        tree = compat.migrate_corrections(compat.migrate_env_algorithms(compat.migrate(tree)))
    except (AttributeError, TypeError, KeyError) as e:  # a hostile or damaged file: say so, no traceback
        raise ConfigError("", f"not a primejax config ({type(e).__name__}: {e})") from None
    merged = default_config()
    _merge(merged, tree, Config, "")
    return lock(merged)


def _merge(dst: ConfigDict, src: dict, cls: type, prefix: str) -> None:
    """Overlay a saved tree onto the defaults, checking every key against section `cls`."""
    types = union_types(cls)
    if not isinstance(src, dict):
        raise ConfigError(prefix.rstrip("."), f"must be a JSON object, got {type(src).__name__} {src!r:.80}")
    for key, value in src.items():
        path = f"{prefix}{key}"
        if key not in types:
            raise ConfigError(path, "unknown key")
        kind, arg = field_kind(types[key])
        try:
            _merge_one(dst, key, value, kind, arg, path)
        except (
            TypeError,
            ValueError,
        ) as e:  # ConfigDict refusing the value's type, tuple() of a non-list, ...
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(path, f"bad value {value!r:.80} ({str(e)[:200]})") from None


def _merge_one(dst: ConfigDict, key: str, value: Any, kind: str, arg: Any, path: str) -> None:
    if kind in ("entries", "dict", "tuple"):
        want = list if kind == "tuple" else dict
        if not isinstance(value, want):
            raise ConfigError(
                path,
                f"must be a JSON {'list' if want is list else 'object'}, got "
                f"{type(value).__name__} {value!r:.80}",
            )
    if kind == "section":
        _merge(dst[key], value, arg, f"{path}.")
    elif kind == "entries":
        entries = ConfigDict()
        for name, entry in value.items():
            entries[name] = to_configdict(arg)
            _merge(entries[name], entry, arg, f"{path}.{name}.")
        dst[key] = entries
    elif kind == "dict":
        dst[key] = ConfigDict(value)
    elif kind == "tuple":
        dst[key] = tuple(value)
    elif kind == "optional":
        dst[key] = value if value is None or isinstance(value, FieldReference) else arg(value)
    else:
        dst[key] = arg(value) if arg is float and isinstance(value, int) else value


__all__ = [
    "Config",
    "ConfigError",
    "FieldReference",
    "default_config",
    "env",
    "typed",
    "validate",
    "keys",
    "lock",
    "to_json",
    "from_json",
    "get",
    "option",
    "section",
    "sub",
]
