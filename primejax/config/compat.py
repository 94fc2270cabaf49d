"""Resolved configs saved before a key changed (`<run>/configs/*.json`): load them, or say what changed.

Each entry of `RENAMED` maps an old leaf name to its new name and a converter; `migrate()` applies them
anywhere in the tree. A value that cannot be converted fails with one line naming the old key and the new one.
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
