"""Environments by id: builtins, user loaders by import path, and verifiers tasksets.

`load_env(id, args)` resolves, in order:
1. a registered id (the builtins `reverse-text`, `alphabet-sort`, `arithmetic`, or one added with
   `register_env`);
2. an import path `pkg.module:function` whose function takes `**args` and returns an `Environment`;
3. otherwise a verifiers taskset id, driven in process (`primejax.envs.verifiers_adapter`), by verifiers' own
   loop (`primejax.envs.verifiers_loop`) or on verifiers' env servers (`primejax.envs.env_server`,
   `args.driver = "env_server"`), as its `args.driver` says.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from primejax.envs.base import Environment

EnvLoader = Callable[..., Environment]

# Builtins are import paths, not imported modules, so loading the registry imports nothing heavy.
_REGISTRY: dict[str, str | EnvLoader] = {
    "reverse-text": "primejax.envs.reverse_text:load",
    "alphabet-sort": "primejax.envs.alphabet_sort:load",
    "arithmetic": "primejax.envs.arithmetic:load",
}


def register_env(env_id: str, loader: str | EnvLoader) -> None:
    """Make `env_id` loadable by `load_env`; `loader` is a callable or a `module:function` path."""
    _REGISTRY[env_id] = loader


def registered_envs() -> list[str]:
    return sorted(_REGISTRY)


def _import(path: str) -> EnvLoader:
    module, _, attr = path.partition(":")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ImportError(f"environment loader {path!r}: {module} has no callable {attr!r}")
    return fn


def load_env(env_id: str, args: dict[str, Any] | None = None) -> Environment:
    args = dict(args or {})
    if env_id in _REGISTRY:
        loader = _REGISTRY[env_id]
        env = (_import(loader) if isinstance(loader, str) else loader)(**args)
    elif ":" in env_id:
        env = _import(env_id)(**args)
    elif args.get("driver") == "env_server":  # verifiers' own env servers (primejax.envs.env_server)
        from primejax.envs.env_server import load as load_served

        args.pop("driver")
        env = load_served(env_id, **args)
    else:
        # args.driver: in process or verifiers' own loop
        from primejax.envs.verifiers_loop import load as load_verifiers

        env = load_verifiers(env_id, **args)
    if not isinstance(env, Environment):
        raise TypeError(f"environment {env_id!r} loaded a {type(env).__name__}, not a primejax Environment")
    return env
