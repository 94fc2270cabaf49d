"""A hand-written Qwen3 renderer: ChatML written by us, so past turns are never re-rendered.

Qwen3's chat template strips `<think>...</think>` from past assistant turns, so re-rendering a conversation
after a reasoning turn does not start with the ids the model was actually given and sampled: the extension
property breaks on every turn and each model call becomes its own training sample
(docs/architecture.md#multi-turn-trajectories).
This renderer's `bridge_to_next_turn` instead keeps the previous prompt and completion ids verbatim (thinking
included), closes the assistant turn if sampling stopped without `<|im_end|>`, and appends only the new
environment messages plus the generation prompt, so every turn extends the last one by construction.

Format (as Qwen3's template for plain messages): `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message;
consecutive `tool` messages become one user turn of `<tool_response>` blocks; the generation prompt is
`<|im_start|>assistant\\n`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from primejax.rendering.messages import Message

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
GENERATION_PROMPT = f"{IM_START}assistant\n"


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def render_text(messages: list[Message]) -> str:
    """ChatML text of `messages` (no generation prompt)."""
    out, i = [], 0
    while i < len(messages):
        role = messages[i]["role"]
        if role == "tool":
            bodies = []
            while i < len(messages) and messages[i]["role"] == "tool":
                bodies.append(f"\n<tool_response>\n{_text(messages[i].get('content'))}\n</tool_response>")
                i += 1
            out.append(f"{IM_START}user{''.join(bodies)}{IM_END}\n")
            continue
        out.append(f"{IM_START}{role}\n{_text(messages[i].get('content'))}{IM_END}\n")
        i += 1
    return "".join(out)


def _no_tools(tools: list[dict[str, Any]] | None) -> None:
    if tools:
        raise ValueError(
            "the hand-written qwen3 renderer cannot render tool schemas: give the tokenizer Qwen3's "
            "<tool_call>/<tool_response> tokens so the renderers package's qwen3 is used"
        )


@dataclass
class ParsedResponse:
    content: str
    reasoning_content: str | None = None
    tool_calls: list[str] = field(default_factory=list)  # raw `<tool_call>` bodies


class Qwen3Renderer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.im_end = tokenizer.convert_tokens_to_ids(IM_END)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_ids(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        _no_tools(tools)
        return self._encode(render_text(messages) + GENERATION_PROMPT)

    def parse_response(self, completion_ids: list[int]) -> str:
        """The assistant message's text as the model wrote it (thinking kept, so the history stays verbatim)."""
        return self.tokenizer.decode(completion_ids, skip_special_tokens=True)

    def parse(self, completion_ids: list[int]) -> ParsedResponse:
        """Structured view: reasoning (the `<think>` block), content, and raw tool-call bodies."""
        text = self.parse_response(completion_ids)
        reasoning = None
        if THINK_END in text:
            head, _, text = text.partition(THINK_END)
            reasoning = head.replace(THINK_START, "", 1).strip()
        calls = []
        while "<tool_call>" in text:
            before, _, rest = text.partition("<tool_call>")
            body, _, after = rest.partition("</tool_call>")
            calls.append(body.strip())
            text = before + after
        return ParsedResponse(content=text.strip(), reasoning_content=reasoning, tool_calls=calls)

    def bridge_to_next_turn(
        self,
        prev_prompt_ids: list[int],
        prev_completion_ids: list[int],
        new_messages: list[Message],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int] | None:
        _no_tools(tools)
        if any(m.get("role") == "assistant" for m in new_messages):
            return None  # the environment rewrote the model's side: only a full re-render is honest
        ids = list(prev_prompt_ids) + list(prev_completion_ids)
        if not prev_completion_ids or prev_completion_ids[-1] != self.im_end:
            ids.append(
                self.im_end
            )  # truncated or stopped on another token: close the turn as the template would
        return ids + self._encode("\n" + render_text(new_messages) + GENERATION_PROMPT)
