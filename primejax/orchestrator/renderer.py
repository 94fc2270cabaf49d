"""Messages <-> token ids with the policy's own tokenizer, so the ids we send are the ids we train on.

`ChatTemplateRenderer` wraps the tokenizer's chat template. Its `bridge_to_next_turn` returns None: a generic
template gives no proof that re-rendering keeps earlier turns byte-identical, so the rollout loop re-renders
the whole conversation and the sample builder checks the extension property token by token (a broken prefix
starts a new training sample). Hand-written renderers that extend the previous ids verbatim (qwen3, which
keeps past `<think>` blocks) plug in through `register_renderer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from primejax.envs.base import Message


class Renderer(Protocol):
    def render_ids(self, messages: list[Message]) -> list[int]: ...

    def parse_response(self, completion_ids: list[int]) -> str: ...

    def bridge_to_next_turn(self, prev_prompt_ids: list[int], prev_completion_ids: list[int],
                            new_messages: list[Message]) -> list[int] | None: ...


class ChatTemplateRenderer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def render_ids(self, messages: list[Message]) -> list[int]:
        # Render to text then encode without extra specials: the template already wrote them, and some
        # tokenizers' `tokenize=True` path adds a BOS the server would not see.
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def parse_response(self, completion_ids: list[int]) -> str:
        return self.tokenizer.decode(completion_ids, skip_special_tokens=True)

    def bridge_to_next_turn(self, prev_prompt_ids: list[int], prev_completion_ids: list[int],
                            new_messages: list[Message]) -> list[int] | None:
        return None


_RENDERERS: dict[str, Callable[[Any], Renderer]] = {"default": ChatTemplateRenderer}


def register_renderer(name: str, factory: Callable[[Any], Renderer]) -> None:
    _RENDERERS[name] = factory


def build_renderer(name: str, tokenizer: Any) -> Renderer:
    """`auto` picks a hand-written renderer named after the model family when one is registered."""
    if name == "auto":
        family = str(getattr(tokenizer, "name_or_path", "")).lower()
        name = next((n for n in _RENDERERS if n != "default" and n in family), "default")
    if name not in _RENDERERS:
        raise KeyError(f"unknown renderer {name!r} (registered: {sorted(_RENDERERS)})")
    return _RENDERERS[name](tokenizer)


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    return AutoTokenizer.from_pretrained(model_path)
