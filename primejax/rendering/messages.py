"""The chat message both environments and renderers speak: a plain OpenAI-style dict
(`{"role": ..., "content": ...}`, plus `tool_calls` / `tool_call_id` / `name` where the turn has them)."""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]
