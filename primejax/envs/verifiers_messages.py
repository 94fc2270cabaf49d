"""Messages between primejax's OpenAI-style dicts and verifiers' typed messages, for both in-process modules
(verifiers_adapter.py drives one trace, verifiers_episode.py an Env's seats); a module of its own so neither
imports the other for them."""

from __future__ import annotations

from typing import Any

from primejax.envs.base import Message


def to_dict(message: Any) -> Message:
    return message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)


def vf_message(message: Message) -> dict[str, Any]:
    """A primejax (OpenAI-style) message as verifiers' typed message: flat tool calls, no unknown keys."""
    out = {
        k: v
        for k, v in message.items()
        if k in ("role", "content", "reasoning_content", "tool_call_id", "name")
    }
    if message.get("role") == "assistant":
        out.setdefault("content", message.get("content") or "")
        calls = message.get("tool_calls")
        if calls:
            out["tool_calls"] = [
                {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in calls
            ]
    elif out.get("content") is None:
        out["content"] = ""
    return out
