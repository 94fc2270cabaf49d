"""Messages <-> token ids with the policy's own tokenizer, so the ids we send are the ids we train on.

`ChatTemplateRenderer` wraps the tokenizer's chat template. Its `bridge_to_next_turn` returns None: a generic
template gives no proof that re-rendering keeps earlier turns byte-identical, so the rollout loop re-renders
the whole conversation and the sample builder checks the extension property token by token (a broken prefix
starts a new training sample). Hand-written renderers that extend the previous ids verbatim (`qwen3`, which
keeps past `<think>` blocks, see qwen3_renderer.py) plug in through `register_renderer`.

`orchestrator.renderer.name = "auto"` picks a hand-written renderer whose name appears in the tokenizer's
`name_or_path`, else `qwen3` for a ChatML tokenizer with `<think>` tokens (the Qwen3 family and fine-tunes of
it), else the chat-template renderer. Name one explicitly for anything auto gets wrong.
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


def _qwen3(tokenizer: Any) -> Renderer:
    from primejax.orchestrator.qwen3_renderer import Qwen3Renderer

    return Qwen3Renderer(tokenizer)


_RENDERERS: dict[str, Callable[[Any], Renderer]] = {"default": ChatTemplateRenderer, "qwen3": _qwen3}


def register_renderer(name: str, factory: Callable[[Any], Renderer]) -> None:
    _RENDERERS[name] = factory


def build_renderer(name: str, tokenizer: Any) -> Renderer:
    """`auto` picks a hand-written renderer named after the model family when one is registered."""
    if name == "auto":
        name = detect_renderer(tokenizer)
    if name not in _RENDERERS:
        raise KeyError(f"unknown renderer {name!r} (registered: {sorted(_RENDERERS)})")
    return _RENDERERS[name](tokenizer)


def detect_renderer(tokenizer: Any) -> str:
    family = str(getattr(tokenizer, "name_or_path", "")).lower()
    named = next((n for n in _RENDERERS if n != "default" and n in family), None)
    if named is not None:
        return named
    vocab = tokenizer.get_vocab()
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if all(t in vocab for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>")) and "<|im_start|>" in template:
        return "qwen3"
    return "default"


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    return AutoTokenizer.from_pretrained(model_path)
