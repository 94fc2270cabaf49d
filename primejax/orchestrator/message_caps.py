"""Bounds on what an environment's messages may cost the orchestrator before they are tokenized.

Every message an environment hands over (its prompts, `env_response` turns, the conversation an env-driven
episode passes to the model) is rendered and tokenized on the orchestrator's event loop, which every request,
timer and weight poll shares. A 10 MB message stalled that loop for 90 s and peaked at 2.7 GB (the tool-result
cap of primejax/envs/tool_limits.py covered verifiers' tool results only). So before anything renders them:

- each string inside a message (its content, text parts, tool-call arguments) is cut to `max_chars`
  characters, ending with a marker the model sees; the cut is idempotent (a cut string is at most `max_chars`
  long), so a conversation the env passes again compares equal to the one already recorded. Assistant messages
  are the model's own words (their token ids are recorded): they are never cut, only counted in the total;
- a conversation holding more than `TOTAL_FACTOR * max_chars` characters after the cut, more than
  `MAX_MESSAGES` messages, or a message that is not a plain dict of short keys fails its rollout with one line.

The tool schemas an environment advertises are rendered into the prompt too: they are not cut (a cut schema
would be wrong), but more than `TOTAL_FACTOR * max_chars` characters of them fail the rollout in one line.

`max_chars` is `orchestrator.max_env_message_chars` (0 = `auto_limit(max_prompt_tokens)`).
"""

from __future__ import annotations

import json
from typing import Any

#: A conversation may hold this many times `max_chars` characters in all (several turns of long messages).
TOTAL_FACTOR = 8
MAX_MESSAGES = 4096
MAX_KEY_CHARS = 64
#: How deep a message's values may nest (content parts, tool calls and their function dicts need 4).
MAX_DEPTH = 8
#: The smallest limit: room for the marker and some text.
MIN_CHARS = 1024


def auto_limit(max_prompt_tokens: int) -> int:
    """The default limit: 16 characters per prompt token (text averages about 4), at least 4096. A longer
    message could not fit in the prompt anyway unless it is mostly runs of one character."""
    return max(4096, 16 * max_prompt_tokens)


def cap_text(text: str, max_chars: int) -> str:
    """`text`, or its head plus a marker when longer than `max_chars`; the result is never longer than
    `max_chars` (so capping twice changes nothing)."""
    if len(text) <= max_chars:
        return text
    marker = f"\n[environment message truncated: {{}} of {len(text)} characters shown]"
    keep = max(0, max_chars - len(marker) - 12)  # 12: room for the shown count's digits
    return text[:keep] + marker.format(keep)


def _cap_value(value: Any, max_chars: int | None, depth: int, total: list[int]) -> Any:
    """`value` with its strings cut to `max_chars` (None = not cut), their lengths added to `total[0]`."""
    if isinstance(value, str):
        out = value if max_chars is None else cap_text(value, max_chars)
        total[0] += len(out)
        return out
    if depth >= MAX_DEPTH:
        raise ValueError(f"an environment message nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        if len(value) > MAX_MESSAGES:
            raise ValueError(f"an environment message has {len(value)} keys")
        out = {}
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
                raise ValueError(
                    f"an environment message has a key that is not a short string: {str(key)[:80]!r}"
                )
            out[key] = _cap_value(item, max_chars, depth + 1, total)
        return out
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_MESSAGES:
            raise ValueError(f"an environment message holds a list of {len(value)} items")
        return [_cap_value(item, max_chars, depth + 1, total) for item in value]
    return value


def cap_messages(messages: Any, max_chars: int) -> list[dict[str, Any]]:
    """Copies of `messages` with every string cut to `max_chars` (module docstring); ValueError for what is not
    a list of message dicts or holds too much in all."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(
            f"environment messages must be a list of message dicts, got {type(messages).__name__}"
        )
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"an environment handed over {len(messages)} messages (at most {MAX_MESSAGES})")
    total = [0]
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError(f"an environment message must be a dict, got {type(message).__name__}")
        out.append(_cap_value(message, None if message.get("role") == "assistant" else max_chars, 0, total))
    if total[0] > TOTAL_FACTOR * max_chars:
        raise ValueError(
            f"environment messages hold {total[0]} characters > {TOTAL_FACTOR} x "
            f"orchestrator.max_env_message_chars ({max_chars})"
        )
    return out


def check_tools(tools: Any, max_chars: int) -> Any:
    """`tools` (None or a list of tool-schema dicts) unchanged; ValueError when they are not, or when their JSON
    holds more than `TOTAL_FACTOR * max_chars` characters."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(
            f"an environment's tools must be a list of tool-schema dicts, got {type(tools).__name__}"
        )
    try:
        size = len(json.dumps(tools, default=str))
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"an environment's tool schemas are not JSON ({type(e).__name__})") from None
    if size > TOTAL_FACTOR * max_chars:
        raise ValueError(
            f"an environment's tool schemas hold {size} characters > {TOTAL_FACTOR} x "
            f"orchestrator.max_env_message_chars ({max_chars})"
        )
    return tools
