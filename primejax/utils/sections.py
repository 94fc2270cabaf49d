"""Typed config sections: the machinery every component's config is written with.

A section is a frozen dataclass whose fields are declared with `option(default, doc, ...)`: the default, a
one-line doc, and the allowed values (`choices`, bounds). Constructing a section checks those and then its own
`check()` rules, raising `ConfigError` with the field's name; `build()` prefixes the dotted path, so every bad
value ends in one line such as `trainer.optim.lr: must be >= 0, got -1.0`.

The user's surface stays an ml-collections `ConfigDict` (edited in `configs/*.py`, overridden with
`--config.a.b=v`): `to_configdict()` writes a section's defaults as one, `build()` reads one back into the typed
section, and `describe()` lists every key with its doc (`--help=keys`). Adding a key is one `option(...)` line
in the section that owns it (docs/configuration.md).

Field types understood: bool, int, float, str, `float | None`, `tuple[str, ...]`, a nested section, `dict`
(free-form keyword arguments) and `dict[str, Section]` (named entries such as `orchestrator.envs`).

A section class may be polymorphic (an algorithm's config, chosen by its `type`): it defines `variants()` (every
concrete class) and `variant(node)` (the one a tree node selects). Its ConfigDict holds the union of the
variants' keys; the typed view is the selected variant, and a key of another variant set away from its default
is an error naming the variants that own it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # ml_collections is imported where a ConfigDict is made or read: the GPU image lacks it
    from ml_collections import ConfigDict

T = TypeVar("T", bound="Section")
_MISSING = dataclasses.MISSING
# Largest sizes accepted at start-up (beyond these a run fails later, e.g. allocating a 1e12-token row).
MAX_TOKENS = 1 << 22  # 4M tokens in one sequence
MAX_ROWS = 1 << 20
MAX_STEPS = 1 << 30


class ConfigError(ValueError):
    """A bad configuration value. `key` is the dotted path, e.g. `orchestrator.group_size`."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


def option(
    default: Any = _MISSING,
    doc: str = "",
    *,
    choices: tuple | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A section field: its default (or `factory` for dicts and sub-sections), a one-line doc, allowed values."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "le": le}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def sub(cls: type, doc: str) -> Any:
    """A nested section field with the sub-section's defaults."""
    return option(doc=doc, factory=cls)


def section(cls: type[T]) -> type[T]:
    """Decorator: a frozen, keyword-only dataclass section."""
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


class Section:
    """Base of every config section: checks declared bounds and choices, then the section's own `check()`."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_field(f, getattr(self, f.name))
        self.check()

    def check(self) -> None:
        """The section's own rules across its fields; raise `ConfigError(field, message)`."""

    @classmethod
    def variants(cls) -> list[type[Section]]:
        """Polymorphic base sections return their concrete classes (see the module doc); others [cls]."""
        return [cls]

    @classmethod
    def variant(cls, node: Mapping[str, Any]) -> type[Section]:
        """The concrete class tree `node` selects (polymorphic bases only)."""
        return cls

    def replace(self: T, **changes: Any) -> T:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _check_field(f: dataclasses.Field, value: Any) -> None:
    m = f.metadata
    if not m or value is None or isinstance(value, (Section, dict, tuple, bool)):
        if m and m.get("choices") and isinstance(value, tuple):
            for v in value:
                if v not in m["choices"]:
                    raise ConfigError(
                        f.name, f"unknown value {v!r} (one of {', '.join(map(str, m['choices']))})"
                    )
        return
    if isinstance(value, float) and not math.isfinite(value):  # every float key, whatever its bounds
        raise ConfigError(f.name, f"must be a finite number, got {value}")
    if m.get("choices") is not None and value not in m["choices"]:
        raise ConfigError(f.name, f"must be one of {', '.join(map(str, m['choices']))}; got {value!r}")
    if m.get("gt") is not None and not value > m["gt"]:
        raise ConfigError(f.name, f"must be > {m['gt']}, got {value}")
    if m.get("ge") is not None and not value >= m["ge"]:
        raise ConfigError(f.name, f"must be >= {m['ge']}, got {value}")
    if m.get("le") is not None and not value <= m["le"]:
        raise ConfigError(f.name, f"must be <= {m['le']}, got {value}")


def _plain(value: Any) -> Any:
    if isinstance(value, Section):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------- field types


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def field_kind(tp: Any) -> tuple[str, Any]:
    """('section', cls) | ('entries', cls) | ('dict', None) | ('tuple', None) | ('optional', base) | ('scalar', tp)."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, Section):
        return "section", tp
    if tp is dict or origin in (dict, Mapping):
        args = typing.get_args(tp)
        if len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], Section):
            return "entries", args[1]
        return "dict", None
    if tp is tuple or origin is tuple:
        return "tuple", None
    if origin in (typing.Union, types.UnionType):
        base = [a for a in typing.get_args(tp) if a is not type(None)]
        return "optional", base[0]
    return "scalar", tp


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is _MISSING else f.default  # type: ignore[misc]


def polymorphic(cls: type) -> bool:
    return "variants" in cls.__dict__


def union_types(cls: type) -> dict[str, Any]:
    """Field types of a section, or of every variant of a polymorphic one (first declaration wins)."""
    out: dict[str, Any] = {}
    for v in cls.variants() if polymorphic(cls) else [cls]:
        for name, tp in field_types(v).items():
            out.setdefault(name, tp)
    return out


def _owners(cls: type, key: str) -> list[str]:
    return [getattr(v, "name", v.__name__) for v in cls.variants() if key in field_types(v)]


def _merge_into(dst: Any, src: Any) -> None:
    """Add the keys of ConfigDict `src` missing from `dst`, recursively (the union of variants' trees)."""
    for key, value in src.items():
        if key not in dst:
            dst[key] = value
        elif _is_configdict(value) and _is_configdict(dst[key]):
            _merge_into(dst[key], value)


def _section_tree(cls: type, value: Any) -> ConfigDict:
    if not polymorphic(cls):
        return to_configdict(value)
    from ml_collections import ConfigDict

    tree = ConfigDict()
    _merge_into(tree, to_configdict(value))  # the value's own keys and values first
    for v in cls.variants():
        _merge_into(tree, to_configdict(v))
    return tree


def to_configdict(value: Section | type[Section]) -> ConfigDict:
    """A section (and its sub-sections) as a ConfigDict: the tree config files edit. Given a class, its
    defaults (without checking them: an entry's defaults may need filling in, like an env's id)."""
    from ml_collections import ConfigDict, FieldReference
    from ml_collections.config_dict import placeholder

    out = ConfigDict()
    cls = value if isinstance(value, type) else type(value)
    types = field_types(cls)
    for f in dataclasses.fields(cls):
        kind, arg = field_kind(types[f.name])
        v = _default(f) if isinstance(value, type) else getattr(value, f.name)
        if kind == "section":
            out[f.name] = _section_tree(arg, v)
        elif kind == "entries":
            out[f.name] = ConfigDict({k: _section_tree(arg, e) for k, e in v.items()})
        elif kind == "dict":
            out[f.name] = ConfigDict(dict(v))
        elif kind == "optional":
            out[f.name] = FieldReference(v, field_type=arg) if v is not None else placeholder(arg)
        else:
            out[f.name] = v
    return out


def _deref(value: Any) -> Any:
    return value.get() if type(value).__name__ == "FieldReference" else value


def _is_configdict(value: Any) -> bool:
    return type(value).__name__ in ("ConfigDict", "FrozenConfigDict")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    value = _deref(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (bool, int, float, str) and not (
        isinstance(value, tp) and (tp is bool or not isinstance(value, bool))
    ):
        raise ConfigError(key, f"must be a {tp.__name__}, got {value!r}")
    return value


def build(cls: type[T], node: Any, path: str = "") -> T:
    """The typed section `cls` from a ConfigDict (or mapping) node; errors name the dotted key under `path`."""
    if _is_configdict(node):
        node = dict(node.items())
    if not isinstance(node, Mapping):
        raise ConfigError(path, f"must be a section, got {node!r}")
    if polymorphic(cls):
        return _build_variant(cls, node, path)
    return _build_fields(cls, node, path)


def _build_fields(cls: type[T], node: Mapping[str, Any], path: str) -> T:
    types = field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in node:
        if key not in names:
            raise ConfigError(_join(path, key), "unknown key")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in node:
            continue  # the default
        key, value = _join(path, f.name), node[f.name]
        kind, arg = field_kind(types[f.name])
        if kind == "section":
            kwargs[f.name] = build(arg, value, key)
        elif kind == "entries":
            kwargs[f.name] = {str(k): build(arg, v, _join(key, str(k))) for k, v in _items(key, value)}
        elif kind == "dict":
            kwargs[f.name] = {str(k): _to_plain(v) for k, v in _items(key, value)}
        elif kind == "tuple":
            if isinstance(value, str) or not isinstance(value, (tuple, list)):
                raise ConfigError(key, f"must be a list, got {value!r}")
            kwargs[f.name] = tuple(value)
        elif kind == "optional":
            value = _deref(value)
            kwargs[f.name] = None if value is None else _coerce(key, value, arg)
        else:
            kwargs[f.name] = _coerce(key, value, arg)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(_join(path, e.key), e.message) from None


def _build_variant(cls: type[T], node: Mapping[str, Any], path: str) -> T:
    try:
        concrete = cls.variant(node)
    except ConfigError as e:
        raise ConfigError(_join(path, e.key), e.message) from None
    own = {f.name for f in dataclasses.fields(concrete)}
    union = dict(_section_tree(cls, concrete).items())
    kept = {}
    for key, value in node.items():
        if key in own:
            kept[key] = value
            continue
        if key not in union:
            raise ConfigError(_join(path, key), "unknown key")
        if _plain(_to_plain(value)) != _plain(_to_plain(union[key])):
            owners = ", ".join(_owners(cls, key))
            raise ConfigError(_join(path, key), f"{node.get('type')!r} has no {key!r} (a key of {owners})")
    return _build_fields(concrete, kept, path)


def _items(key: str, value: Any) -> Iterator[tuple[Any, Any]]:
    if _is_configdict(value) or isinstance(value, Mapping):
        return iter(value.items())
    raise ConfigError(key, f"must be a mapping, got {value!r}")


def _to_plain(value: Any) -> Any:
    if _is_configdict(value):
        return value.to_dict()
    return _deref(value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path and key else path or key


def describe(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, doc) of every key of section `cls`, in declaration order (`--help=keys`)."""
    rows: list[tuple[str, Any, str]] = []
    types = field_types(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        kind, arg = field_kind(types[f.name])
        doc = f.metadata.get("doc", "")
        if f.metadata.get("choices") and kind != "tuple":
            doc += f" [{' | '.join(map(str, f.metadata['choices']))}]"
        if kind == "section":
            if doc:
                rows.append((key, "{...}", doc))
            rows += _describe_section(arg, f"{key}.", _default(f))
        elif kind == "entries":
            rows.append((key, "{" + ", ".join(_default(f)) + "}", doc))
            rows += _describe_section(arg, f"{key}.<name>.")
        else:
            rows.append((key, _plain(_default(f)), doc))
    return rows


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    out = {}
    for key, v in value.items():
        if isinstance(v, dict) and v and key not in ("args", "kwargs", "roles"):
            out.update(_flat(v, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = v
    return out


def _describe_section(cls: type, prefix: str, default: Any = None) -> list[tuple[str, Any, str]]:
    if not polymorphic(cls):
        return describe(cls, prefix)
    actual = _flat(default.to_dict(), prefix) if isinstance(default, Section) else {}
    variants = cls.variants()
    rows: dict[str, tuple[Any, str]] = {}
    owners: dict[str, list[str]] = {}
    for v in variants:
        for key, default, doc in describe(v, prefix):
            rows.setdefault(key, (default, doc))
            owners.setdefault(key, []).append(getattr(v, "name", v.__name__))
    out = []
    for key, (value, doc) in rows.items():
        if len(owners[key]) < len(variants):
            doc = f"{doc} ({', '.join(owners[key])})"
        out.append((key, actual.get(key, value), doc))
    return out


def replace_key(value: T, key: str, new: Any) -> T:
    """A copy of section `value` with the dotted `key` set to `new` (sub-sections copied along the way)."""
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(value, **{head: new})
    return dataclasses.replace(value, **{head: replace_key(getattr(value, head), rest, new)})


def replace_keys(value: T, changes: Mapping[str, Any]) -> T:
    """A copy of section `value` with every dotted key of `changes` set (`replace_key`, one after another)."""
    for key, new in changes.items():
        value = replace_key(value, key, new)
    return value


__all__ = [
    "ConfigError",
    "Section",
    "section",
    "option",
    "sub",
    "build",
    "to_configdict",
    "describe",
    "replace_key",
    "replace_keys",
]
