"""Resolved configs saved before a key changed (`<run>/configs/*.json`): load them, or say what changed.

Each entry of `RENAMED` maps an old leaf name to its new name and a converter; `migrate()` applies them
anywhere in the tree. A value that cannot be converted fails with one line naming the old key and the new one.
`migrate_env_algorithms()` turns an env's old algorithm name (and custom advantage) into its own block.
`migrate_corrections()` keeps the behaviour of correction blocks saved before the corrections followed their
papers (docs/algorithms.md#corrections).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from primejax.utils.sections import ConfigError


def _json_object(text: Any) -> dict:
    value = json.loads(text) if isinstance(text, str) else text
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


# old leaf name -> (new leaf name, converter of the old value)
RENAMED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "kwargs_json": ("kwargs", _json_object),  # JSON-in-a-string became a real mapping
    "roles_json": ("roles", _json_object),
}


def migrate(tree: dict[str, Any], path: str = "") -> dict[str, Any]:
    """A copy of a saved config tree with old keys renamed to their current form."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        where = f"{path}.{key}" if path else key
        if key in RENAMED:
            new, convert = RENAMED[key]
            try:
                value = convert(value)
            except (ValueError, TypeError) as e:
                raise ConfigError(
                    where, f"was renamed to {new!r} (a mapping) and {value!r} does not convert ({e})"
                ) from None
            key = new
        out[key] = migrate(value, where) if isinstance(value, dict) else value
    return out


def _algorithm_keys(name: str) -> set[str]:
    import dataclasses

    from primejax.orchestrator.algorithms.base import AlgorithmConfig, registered_config_class

    return {f.name for f in dataclasses.fields(registered_config_class(name) or AlgorithmConfig)}


def migrate_env_algorithms(tree: dict[str, Any]) -> dict[str, Any]:
    """Before per-env algorithm blocks, an env named an algorithm type (`algo: "opd"`) that took the global
    block's options, plus its own custom advantage (`advantage: {...}`): both become the env's own block."""
    orch = tree.get("orchestrator")
    if not isinstance(orch, dict):
        return tree
    default = orch.get("algo", {})
    for table in (orch.get("envs"), (orch.get("eval") or {}).get("envs")):
        for entry in (table or {}).values():
            if not isinstance(entry, dict) or not isinstance(entry.get("algo", {}), str):
                continue
            name, advantage = entry.pop("algo"), entry.pop("advantage", {}) or {}
            if not name and not advantage.get("import_path"):
                entry["algo"] = {"type": ""}
                continue
            block = json.loads(json.dumps(default))
            block["type"] = name or default.get("type", "grpo")
            if advantage.get("import_path"):
                block["advantage"] = advantage
            own = _algorithm_keys(block["type"])  # the global block's options of other algorithms stay behind
            entry["algo"] = {k: v for k, v in block.items() if k in own}
    return tree


def migrate_corrections(tree: dict[str, Any]) -> dict[str, Any]:
    """Correction blocks saved before `cispo.mask` existed ran cispo with DPPO's masks, gspo summed over tokens
    and `reject.level = "sequence"` on the sequence's mean divergence: they get the settings that keep those
    (`cispo.mask = "dppo"`, `gspo.norm = "token"`, `reject.level = "geometric"`). A saved block has every key,
    so a `cispo` without `mask` is an old one."""
    for key, value in tree.items():
        if not isinstance(value, dict):
            continue
        cispo = value.get("cispo")
        if key == "correction" and isinstance(cispo, dict) and "mask" not in cispo:
            cispo["mask"] = "dppo"
            if isinstance(value.get("gspo"), dict):
                value["gspo"].setdefault("norm", "token")
            reject = value.get("reject")
            if isinstance(reject, dict) and reject.get("level") == "sequence":
                reject["level"] = "geometric"
        else:
            migrate_corrections(value)
    return tree
