"""Bounds on what one tool call may cost a rollout: its time and the size of what it returns.

A tool's result becomes a message the renderer tokenizes before the prompt-length check; a 10 MB result cost
3.5 GB and 30 s, 200 MB was killed by the kernel. So the text is cut to `max_tool_output_chars` *before* it
joins the conversation, with a marker the model sees (it can ask for less). A tool that does not answer within
`tool_timeout_s` errors its rollout (counted under `errors/env`); the other rollouts go on. Both are set per
environment in `orchestrator.envs.<name>.args` (docs/verifiers.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

DEFAULT_MAX_TOOL_OUTPUT_CHARS = 16384
DEFAULT_TOOL_TIMEOUT_S = 120.0
T = TypeVar("T")


class ToolTimeout(RuntimeError):
    """A tool call ran past its timeout (errors the rollout)."""


def cap_tool_output(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` characters plus a one-line marker saying how much was dropped."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[tool output truncated: {max_chars} of {len(text)} characters shown]"


async def with_timeout(call: Awaitable[T], timeout_s: float, what: str) -> T:
    try:
        return await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        raise ToolTimeout(f"{what} did not answer within {timeout_s:g} s (tool_timeout_s)") from None


def check_limits(max_tool_output_chars: int, tool_timeout_s: float) -> None:
    if not isinstance(max_tool_output_chars, int) or max_tool_output_chars < 1:
        raise ValueError(f"max_tool_output_chars must be an int >= 1, got {max_tool_output_chars!r}")
    if not isinstance(tool_timeout_s, (int, float)) or not 0 < tool_timeout_s < 86400:
        raise ValueError(f"tool_timeout_s must be seconds in (0, 86400), got {tool_timeout_s!r}")
