"""verifiers ids: which module a taskset / env id names, the Taskset and Env it exports, and loading them.

Ids resolve as verifiers' loader resolves them (`my-taskset` -> `verifiers.v1.tasksets.my_taskset` when that
exists, else the installed `my_taskset`); an id with a dot is a module path (`verifiers.v1.tasksets.textarena`,
`my_pkg.my_taskset`). The module exports its Taskset (and optionally its Env) via `__all__`. Unlike verifiers'
loader, an error raised while importing the module is reported as that error, not as "not installed".
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any


def _vf():
    import verifiers.v1 as vf  # deferred: verifiers takes seconds to import and most runs use builtins

    return vf


OLD_API_HINT = " (this package targets verifiers < 0.4; primejax speaks verifiers 0.4's verifiers.v1 API)"


class EnvLoadError(ValueError):
    """A verifiers taskset / env that cannot be loaded; the message is one line naming the id and the cause."""


def _module_for(ident: str, group: str, kind: str) -> Any:
    """The module an id names, resolved as verifiers' loader does: a dotted id is a module path; a bare id
    (`my-taskset`, `owner/my-taskset@1.0`) is verifiers' built-in `<group>.<name>` when that exists, else the
    installed package `<name>`. An error raised while importing it is reported as itself, not as "not
    installed" (verifiers' loader turns any ModuleNotFoundError, a missing dependency included, into that)."""
    if "." in ident:
        target = ident
    else:
        name = ident.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
        target = f"{group}.{name}" if importlib.util.find_spec(f"{group}.{name}") else name
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise EnvLoadError(
                f"verifiers {kind} {ident!r}: no module {target!r} is installed (install the package that "
                f"provides it, or name a module path like my_pkg.my_{kind})"
            ) from None
        raise EnvLoadError(
            f"verifiers {kind} {ident!r}: importing {target!r} failed: {type(e).__name__}: {e}"
        ) from e
    except Exception as e:  # noqa: BLE001 - any error inside the package is reported as that error
        hint = OLD_API_HINT if isinstance(e, AttributeError) and "module 'verifiers'" in str(e) else ""
        raise EnvLoadError(
            f"verifiers {kind} {ident!r}: importing {target!r} failed: {type(e).__name__}: {e}{hint}"
        ) from e


def _exported(module: Any, base: type) -> list[type]:
    """The `base` subclasses a module exports (verifiers' plugin convention: `__all__`; else its public names)."""
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    found: list[type] = []
    for n in names:
        obj = getattr(module, n, None)
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base and obj not in found:
            found.append(obj)
    if not hasattr(module, "__all__"):  # public names include imports: keep the module's own classes
        found = [c for c in found if c.__module__ == module.__name__]
    return found


def resolve_taskset(taskset_id: str) -> tuple[type, type | None]:
    """The Taskset class an id names and the Env class its package ships (None: a plain taskset, which
    verifiers runs with `SingleAgentEnv`)."""
    vf = _vf()
    module = _module_for(taskset_id, "verifiers.v1.tasksets", "taskset")
    tasksets = _exported(module, vf.Taskset)
    if len(tasksets) != 1:
        hint = OLD_API_HINT if hasattr(module, "load_environment") else ""
        raise EnvLoadError(
            f"verifiers taskset {taskset_id!r}: module {module.__name__!r} must export exactly one Taskset "
            f"subclass via __all__, found {[c.__name__ for c in tasksets]}{hint}"
        )
    envs = [c for c in _exported(module, vf.Env) if not _is_single_agent(c)]
    if len(envs) > 1:
        raise EnvLoadError(
            f"verifiers taskset {taskset_id!r}: module {module.__name__!r} exports several Envs "
            f"{[c.__name__ for c in envs]}; name one with args.env"
        )
    return tasksets[0], (envs[0] if envs else None)


def _is_single_agent(cls: type) -> bool:
    """verifiers' `SingleAgentEnv` itself (or a subclass that keeps its `run`): one seat on the task's prompt,
    which the in-process driver runs directly."""
    from verifiers.v1.envs.single_agent import SingleAgentEnv

    return issubclass(cls, SingleAgentEnv) and cls.run is SingleAgentEnv.run


def load_taskset(taskset_id: str, args: dict[str, Any]) -> Any:
    """A verifiers taskset by id, its TasksetConfig built from `args` (validated by verifiers' pydantic model)."""
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type

    cls, _ = resolve_taskset(taskset_id)
    config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    return cls(config_cls.model_validate({**args, "id": taskset_id}))


def load_vf_env(env_id: str, taskset_id: str, env_args: dict[str, Any]) -> Any:
    """The vf.Env to run (`args.env`, else the one the taskset ships, else None), holding only its config:
    primejax calls its `setup`/`run`/`finalize`, never its serving machinery."""
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type

    if env_id:
        envs = _exported(_module_for(env_id, "verifiers.v1.envs", "env"), vf.Env)
        if len(envs) != 1:
            raise EnvLoadError(
                f"verifiers env {env_id!r} must export exactly one Env, found {[c.__name__ for c in envs]}"
            )
        cls = envs[0]
    else:
        cls = resolve_taskset(taskset_id)[1]
        if cls is None:
            return None
    config_cls = concrete_type(cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    # The taskset is loaded by primejax (module paths included), so the config validates the env's own fields
    # only; Env.__init__ would load the taskset again by verifiers' loader and every agent's harness.
    config = config_cls.model_validate(env_args)
    env = cls.__new__(cls)
    env.config = config
    return env
