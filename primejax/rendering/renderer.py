"""Messages <-> token ids with the policy's own tokenizer, so the ids we send are the ids we train on.

Model families come from the `renderers` package (rendering/renderers_adapter.py): rendering with tool
schemas, parsing completions into content / reasoning_content / tool_calls, and bridging turns verbatim.
primejax keeps two renderers of its own where they add something: `default` wraps the tokenizer's chat
template (any model; its `bridge_to_next_turn` returns None, so the rollout loop re-renders and the sample
builder checks the extension property token by token), and `qwen3` falls back to the hand-written
qwen3_renderer.py for ChatML tokenizers without Qwen3's tool-call tokens (the package's Qwen3 needs them).

`orchestrator.renderer.name`: `auto` takes the package's family for a known hub model id, else `qwen3` for a
ChatML tokenizer with `<think>` tokens (the Qwen3 family and fine-tunes of it), else `default`; or name any
family of `renderers_adapter.families()` (`llama-3`, `qwen3.5`, `glm-4.5`, `gpt-oss`, ...) or a renderer added
with `register_renderer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from primejax.rendering.messages import Message

Tools = list[dict[str, Any]] | None  # tool schemas, OpenAI `{"type": "function", ...}` or bare {name, ...}


class Renderer(Protocol):
    def render_ids(self, messages: list[Message], tools: Tools = None) -> list[int]: ...

    def parse_response(self, completion_ids: list[int]) -> str: ...

    def bridge_to_next_turn(
        self,
        prev_prompt_ids: list[int],
        prev_completion_ids: list[int],
        new_messages: list[Message],
        tools: Tools = None,
    ) -> list[int] | None: ...


def parse_message(
    renderer: Renderer, completion_ids: list[int], prompt_ids: list[int] | None = None, tools: Tools = None
) -> tuple[Message, list[dict[str, Any]]]:
    """The assistant message of a completion and its malformed tool calls; plain text for renderers that do
    not parse structure."""
    parse = getattr(renderer, "parse_message", None)
    if parse is None:
        return {"role": "assistant", "content": renderer.parse_response(completion_ids)}, []
    turn = parse(completion_ids, prompt_ids=prompt_ids, tools=tools)
    return turn.message, turn.malformed


class ChatTemplateRenderer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def render_ids(self, messages: list[Message], tools: Tools = None) -> list[int]:
        # Render to text then encode without extra specials: the template already wrote them, and some
        # tokenizers' `tokenize=True` path adds a BOS the server would not see.
        kwargs = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def parse_response(self, completion_ids: list[int]) -> str:
        return self.tokenizer.decode(completion_ids, skip_special_tokens=True)

    def bridge_to_next_turn(
        self,
        prev_prompt_ids: list[int],
        prev_completion_ids: list[int],
        new_messages: list[Message],
        tools: Tools = None,
    ) -> list[int] | None:
        return None


def _qwen3(tokenizer: Any) -> Renderer:
    from primejax.rendering.renderers_adapter import QWEN_TOOL_TOKENS, PackageRenderer, has_tokens

    if has_tokens(tokenizer, QWEN_TOOL_TOKENS):
        return PackageRenderer(tokenizer, "qwen3")
    from primejax.rendering.qwen3_renderer import Qwen3Renderer

    return Qwen3Renderer(tokenizer)


_RENDERERS: dict[str, Callable[[Any], Renderer]] = {"default": ChatTemplateRenderer, "qwen3": _qwen3}


def register_renderer(name: str, factory: Callable[[Any], Renderer]) -> None:
    _RENDERERS[name] = factory


def build_renderer(name: str, tokenizer: Any) -> Renderer:
    """`auto` picks a hand-written renderer named after the model family when one is registered."""
    if name == "auto":
        name = detect_renderer(tokenizer)
    if name in _RENDERERS:
        return _RENDERERS[name](tokenizer)
    from primejax.rendering.renderers_adapter import PackageRenderer, families

    known = families()
    if name not in known:
        raise KeyError(
            f"orchestrator.renderer.name: unknown renderer {name!r} (primejax: {sorted(_RENDERERS)}; "
            f"renderers package: {known})"
        )
    return PackageRenderer(tokenizer, name)


def detect_renderer(tokenizer: Any) -> str:
    from primejax.rendering.renderers_adapter import family_for_model

    hub = family_for_model(str(getattr(tokenizer, "name_or_path", "")))
    if hub is not None:
        return hub
    family = str(getattr(tokenizer, "name_or_path", "")).lower()
    named = next((n for n in _RENDERERS if n != "default" and n in family), None)
    if named is not None:
        return named
    vocab = tokenizer.get_vocab()
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if (
        all(t in vocab for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"))
        and "<|im_start|>" in template
    ):
        return "qwen3"
    return "default"


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    return AutoTokenizer.from_pretrained(model_path)
