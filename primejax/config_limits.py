"""Value checks every config gets on top of `config.validate`'s cross-field rules: finite numbers, sizes in a
range a machine can hold, and run locations that cannot name a project's own directory.

Generic over the tree (every float leaf is checked, whatever section it lives in), so a key added later is
covered without being listed. Every failure is a `ConfigError` naming the key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# Largest sizes accepted at start-up (beyond these a run fails later, e.g. allocating a 1e12-token row).
MAX_TOKENS = 1 << 22  # 4M tokens in one sequence
MAX_ROWS = 1 << 20
_UPPER = {
    "orchestrator.seq_len": MAX_TOKENS,
    "orchestrator.max_prompt_tokens": MAX_TOKENS,
    "orchestrator.sampling.max_tokens": MAX_TOKENS,
    "inference.max_model_len": MAX_TOKENS,
    "trainer.fake_data.seq_len": MAX_TOKENS,
    "sft.seq_len": MAX_TOKENS,
    "trainer.logprob_chunk_size": MAX_TOKENS,
    "orchestrator.batch_size": MAX_ROWS,
    "orchestrator.group_size": MAX_ROWS,
    "orchestrator.max_concurrent": MAX_ROWS,
    "trainer.micro_batch_size": MAX_ROWS,
    "trainer.fake_data.rows": MAX_ROWS,
    "sft.batch_size": MAX_ROWS,
    "sft.num_examples": 1 << 30,
    "run.max_steps": 1 << 30,
    "sft.steps": 1 << 30,
    "inference.port": 65535,
}
_POSITIVE = ("sft.batch_size", "sft.seq_len", "sft.num_examples")
_NON_NEGATIVE = ("sft.steps", "inference.port")
# A run name is one plain directory name: no separators, no '.'/'..', no '~' or leading '-' or '.'.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=@-]*$")


class _Error(ValueError):
    pass


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    items = node.items() if isinstance(node, Mapping) or hasattr(node, "items") else ()
    for key, value in items:
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) or hasattr(value, "items"):
            yield from _leaves(value, f"{path}.")
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                yield f"{path}[{i}]", v
        else:
            yield path, value


def _get(c: Any, key: str) -> Any:
    node = c
    for part in key.split("."):
        node = node[part]
    return node


def check_limits(c: Any, error: type[Exception]) -> None:
    """Raise `error(key, message)` for the first non-finite float, out-of-range size or unsafe run location."""
    for key, value in _leaves(c):
        if isinstance(value, float) and not math.isfinite(value):
            raise error(key, f"must be a finite number, got {value}")
    for key in _POSITIVE:
        if _get(c, key) <= 0:
            raise error(key, f"must be > 0, got {_get(c, key)}")
    for key in _NON_NEGATIVE:
        if _get(c, key) < 0:
            raise error(key, f"must be >= 0, got {_get(c, key)}")
    for key, upper in _UPPER.items():
        if _get(c, key) > upper:
            raise error(key, f"must be <= {upper}, got {_get(c, key)}")
    if c.sft.steps > 0 and not c.sft.lr > 0:
        raise error("sft.lr", f"must be > 0 when sft.steps > 0, got {c.sft.lr}")
    name = c.run.name
    if not isinstance(name, str) or not _NAME.match(name):
        raise error(
            "run.name",
            f"must be a plain directory name (letters, digits, '_', '-', '.', not starting "
            f"with '.' or '-', no '/' or '~'), got {name!r}",
        )
    out = c.run.output_dir
    if not out or out.startswith("~") or Path(out).resolve() == Path(Path(out).resolve().anchor):
        raise error("run.output_dir", f"must be a directory below the filesystem root (no '~'), got {out!r}")
