"""Command-line parsing shared by every primejax entrypoint.

`python -m primejax.<entry> --config configs/x.py --config.trainer.optim.lr=1e-5 [--dry_run]`

`--config` names a Python file whose `get_config()` returns a ConfigDict built from `primejax.config.default_config()`
(or a JSON file written by `primejax.config.to_json`, which is how the launcher hands children the resolved config).
Overrides use ml-collections' `config_flags`. Any bad key or value ends the program with one line naming the key
and exit status 2, never a traceback.
"""

from __future__ import annotations

import difflib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from absl import flags
from ml_collections import ConfigDict, config_flags

from primejax.config import Config, ConfigError, from_json, keys, lock, typed

USAGE = """usage: python -m {prog} --config CONFIG [--config.KEY=VALUE ...] [options]

{doc}
  --config CONFIG          a Python file under configs/ with get_config(), or a resolved config JSON
  --config.KEY=VALUE       override one key, e.g. --config.trainer.optim.lr=1e-5 --config.run.name=exp1
{extra}  --help                   this message; --help=keys lists every config key with its default
"""


class UsageError(Exception):
    """Raised for bad command lines; `run_main` prints it as one line and exits 2."""


def load_config_file(path: str | Path) -> ConfigDict:
    """Load a config from a `.py` file with `get_config()` or from a resolved `.json`."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--config: no such file: {path}")
    if path.suffix == ".json":
        try:
            return from_json(path.read_text())
        except ConfigError as e:
            raise UsageError(f"--config: {path}: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--config: {path}: not readable as a JSON config ({e})") from None
        except RecursionError:  # json's decoder recurses per nesting level: hostile input, not a config
            raise UsageError(f"--config: {path}: nests too deeply to be a primejax config") from None
    spec = importlib.util.spec_from_file_location(f"primejax_config_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise UsageError(f"--config: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a broken config file is the user's input: report it in one line
        raise UsageError(f"--config: {path} failed to import: {type(e).__name__}: {e}") from None
    if not hasattr(module, "get_config"):
        raise UsageError(f"--config: {path} has no get_config()")
    cfg = module.get_config()
    if not isinstance(cfg, ConfigDict):
        raise UsageError(f"--config: {path}: get_config() must return a ConfigDict")
    return cfg


def _split_config_arg(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Pull `--config X` / `--config=X` out of argv; everything else goes to the flag parser."""
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise UsageError("--config needs a file")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def print_keys() -> None:
    """Every config key with its default and one-line doc (`--help=keys`)."""
    for key, default, doc in keys():
        if default == "{...}":  # a section
            print(f"\n[{key}]  {doc}")
            continue
        line = f"{key} = {default!r}"
        print(f"{line:<60} # {doc}" if doc else line)


def _check_override_keys(tree: ConfigDict, args: Sequence[str]) -> None:
    """Name an unknown `--config.a.b` key ourselves: config_flags reports it as a bare KeyError."""
    for arg in args:
        if not arg.startswith("--config."):
            continue
        key = arg[len("--config.") :].split("=", 1)[0]
        node: Any = tree
        for i, part in enumerate(key.split(".")):
            if not isinstance(node, ConfigDict) or part not in node:
                parent = ".".join(key.split(".")[:i]) or "config"
                options = list(node.keys()) if isinstance(node, ConfigDict) else []
                close = difflib.get_close_matches(part, options, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise UsageError(f"unknown config key {key!r}: {parent} has no {part!r}{hint}")
            node = node[part]


def _flag_error_line(err: Exception) -> str:
    """absl/config_flags errors are multi-line and mention internals; keep the line that names the key."""
    text = str(err.args[0] if isinstance(err, KeyError) and err.args else err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    return first.replace("Could not override field ", "cannot set ").replace(" (reference)", "")


def parse_config(
    argv: Sequence[str],
    *,
    prog: str,
    doc: str = "",
    default_config_path: str | None = None,
    define_flags: Callable[[flags.FlagValues], None] | None = None,
) -> tuple[Config, flags.FlagValues]:
    """Parse argv (without the program name) into the typed, validated config and the extra flags' values.

    The entrypoint's one conversion: from here on, components receive the typed sections they use."""
    fv = flags.FlagValues()
    extra_help = ""
    if define_flags is not None:
        define_flags(fv)
        for name in fv:
            extra_help += f"  --{name:<23}{fv[name].help}\n"
    if any(a in ("-h", "--help", "--helpfull") for a in argv):
        print(USAGE.format(prog=prog, doc=doc, extra=extra_help))
        raise SystemExit(0)
    if "--help=keys" in argv:
        print_keys()
        raise SystemExit(0)

    path, rest = _split_config_arg(argv)
    path = path or default_config_path
    if path is None:
        raise UsageError("--config is required (a file under configs/)")
    tree = lock(load_config_file(path))
    _check_override_keys(tree, rest)
    argv_for_flags = [prog, *rest]
    # config_flags discovers `--config.*` overrides from the argv it is given at definition time.
    try:
        config_flags.DEFINE_config_dict(
            "config", tree, lock_config=True, flag_values=fv, sys_argv=argv_for_flags
        )
        fv(argv_for_flags)
    except (flags.Error, AttributeError, TypeError, KeyError, ValueError) as e:
        raise UsageError(_flag_error_line(e)) from None
    try:
        cfg = typed(fv["config"].value)
    except ConfigError as e:
        raise UsageError(f"config error: {e}") from None
    return cfg, fv


def run_main(main: Callable[[], int | None]) -> None:
    """Run an entrypoint's main; bad input becomes one line on stderr and exit status 2."""
    try:
        code = main()
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(code or 0)
