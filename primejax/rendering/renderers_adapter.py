"""The one module that touches the `renderers` package (a verifiers dependency): messages + tool schemas to
token ids and completions back to structured assistant messages, for the ~25 model families it covers.

`PackageRenderer` wraps `renderers.create_renderer(tokenizer, <Family>RendererConfig(...))` behind primejax's
renderer protocol (rendering/renderer.py): `render_ids(messages, tools)`, `parse_message(ids, ...)` ->
content / reasoning_content / tool_calls, and `bridge_to_next_turn`, which extends the previous prompt and
completion ids verbatim so consecutive model calls merge into one training sample (the extension property).
Thinking retention is `"all"` by default: with a family's template default (e.g. Qwen3 drops past `<think>`
blocks at a new user query) a follow-up user turn re-renders history and each call becomes its own sample.

Tool calls the parser could not read (bad JSON, no name, an unclosed block) are returned separately as
`malformed` so the rollout driver can answer each with a tool error message the model sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from primejax.rendering.messages import Message

#: Tool-call markers the hand-coded Qwen3-style families need in the vocabulary.
QWEN_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def families() -> list[str]:
    """Every family name the installed renderers package registers (`orchestrator.renderer.name` values)."""
    from renderers.base import RENDERER_REGISTRY, _populate_registry

    _populate_registry()
    return sorted(RENDERER_REGISTRY)


def family_for_model(name_or_path: str) -> str | None:
    """The family the package maps a hub model id to (exact match), else None (local paths, fine-tunes)."""
    from renderers.base import MODEL_RENDERER_MAP

    return MODEL_RENDERER_MAP.get(name_or_path)


def _config(family: str, thinking_retention: str | None) -> Any:
    from renderers.configs import config_from_name

    config = config_from_name(family)
    # The package's template-driven `default` cannot bridge at all, so no retention policy applies to it.
    if (
        family != "default"
        and thinking_retention is not None
        and "thinking_retention" in type(config).model_fields
    ):
        config = type(config)(thinking_retention=thinking_retention)
    return config


@dataclass
class ParsedTurn:
    """A completion read back as an assistant message, plus the tool calls that could not be parsed."""

    message: Message
    malformed: list[dict[str, Any]] = field(default_factory=list)  # {"raw", "status"} per broken call


def tool_specs(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool schemas as chat templates receive them: OpenAI's `{"type": "function", "function": {...}}` envelope
    (what transformers and vLLM hand a template, and what verifiers' train client renders). A bare
    `{name, description, parameters}` is wrapped; templates such as Qwen3's print each tool as JSON, so the
    envelope is part of the prompt (tests/orchestrator/test_renderer_families.py)."""
    if not tools:
        return None
    out = []
    for t in tools:
        fn = t.get("function", t)
        out.append(
            {
                "type": "function",
                "function": {
                    "name": fn["name"],
                    "description": fn.get("description") or "",
                    "parameters": fn.get("parameters") or {"type": "object", "properties": {}},
                },
            }
        )
    return out


class PackageRenderer:
    """A renderers-package renderer under primejax's protocol."""

    def __init__(self, tokenizer: Any, family: str, thinking_retention: str | None = "all"):
        from renderers import create_renderer

        self.tokenizer = tokenizer
        self.family = family
        self.impl = create_renderer(tokenizer, _config(family, thinking_retention))
        self._calls = 0

    @property
    def is_prefix_stable(self) -> bool:
        return bool(self.impl.is_prefix_stable)

    def render_ids(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return list(self.impl.render_ids(messages, tools=tool_specs(tools), add_generation_prompt=True))

    def render_conversation_ids(
        self, messages: list[Message], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """A finished conversation (no generation prompt): SFT demonstrations rendered as RL will see them."""
        return list(self.impl.render_ids(messages, tools=tool_specs(tools), add_generation_prompt=False))

    def parse_response(self, completion_ids: list[int]) -> str:
        return self.parse_message(completion_ids).message.get("content") or ""

    def parse_message(
        self,
        completion_ids: list[int],
        *,
        prompt_ids: list[int] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> ParsedTurn:
        from renderers import ToolCallParseStatus

        # The package's parsers find markers by token id, but a model may spell `<tool_call>` in byte pieces
        # (constrained decoding does, and so can a policy early in training): parse the canonical re-encoding
        # of the text. The sampled ids themselves are what the rollout trains on.
        canonical = list(
            self.tokenizer.encode(self.tokenizer.decode(list(completion_ids)), add_special_tokens=False)
        )
        parsed = self.impl.parse_response(canonical, tools=tool_specs(tools), prompt_ids=prompt_ids)
        message: Message = {"role": "assistant", "content": parsed.content or ""}
        if parsed.reasoning_content:
            message["reasoning_content"] = parsed.reasoning_content
        calls, malformed = [], []
        for call in parsed.tool_calls:
            if call.status != ToolCallParseStatus.OK or not call.name:
                malformed.append({"raw": call.raw, "status": str(call.status)})
                continue
            self._calls += 1
            args = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments or {})
            calls.append(
                {
                    "id": call.id or f"call_{self._calls}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": args},
                }
            )
        if calls:
            message["tool_calls"] = calls
        return ParsedTurn(message, malformed)

    def bridge_to_next_turn(
        self,
        prev_prompt_ids: list[int],
        prev_completion_ids: list[int],
        new_messages: list[Message],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int] | None:
        bridged = self.impl.bridge_to_next_turn(
            list(prev_prompt_ids), list(prev_completion_ids), new_messages, tools=tool_specs(tools)
        )
        return None if bridged is None else list(bridged.token_ids)

    def stop_token_ids(self) -> list[int]:
        return list(self.impl.get_stop_token_ids())


def has_tokens(tokenizer: Any, tokens: tuple[str, ...]) -> bool:
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in tokens)
