"""The renderers-package adapter on locally built tokenizers (no hub): ids equal the tokenizer's own chat
template where the template is prefix-stable, thinking retention "all" keeps the extension property across a
follow-up user turn (the family default re-renders), tool calls parse into structured messages."""

from __future__ import annotations

import json

import pytest

from primejax.rendering.renderer import ChatTemplateRenderer, build_renderer
from primejax.rendering.renderers_adapter import PackageRenderer, families, tool_specs

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "three"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc_add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from primejax.models.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("tool-tokenizer")
    build_tokenizer(out, tool_tokens=True)
    return AutoTokenizer.from_pretrained(str(out))


def test_families_are_the_packages_and_unknown_names_fail_clearly(tool_tokenizer):
    names = families()
    assert {"qwen3", "qwen3.5", "llama-3", "glm-4.5", "gpt-oss", "deepseek-v3", "kimi-k2", "default"} <= set(
        names
    )
    with pytest.raises(KeyError, match="orchestrator.renderer.name: unknown renderer 'nope'"):
        build_renderer("nope", tool_tokenizer)


@pytest.mark.parametrize("family", ["qwen3", "default"])
def test_ids_equal_the_chat_template_on_prefix_stable_conversations(tool_tokenizer, family):
    """The tiny tokenizer's template is Qwen's ChatML for plain messages (no reasoning, no tools): the
    package's qwen3 and its template-driven default must both reproduce it token for token."""
    renderer = PackageRenderer(tool_tokenizer, family)
    template = ChatTemplateRenderer(tool_tokenizer)
    for messages in CONVERSATIONS:
        assert renderer.render_ids(messages) == template.render_ids(messages)


def test_thinking_retention_all_keeps_the_extension_property_across_a_user_turn(tool_tokenizer):
    tok = tool_tokenizer
    prompt = [{"role": "user", "content": "one"}]
    completion = tok.encode("<think>plan</think>first<|im_end|>", add_special_tokens=False)
    follow_up = [{"role": "user", "content": "two"}]
    kept = PackageRenderer(tok, "qwen3")  # thinking_retention="all"
    p1 = kept.render_ids(prompt)
    bridged = kept.bridge_to_next_turn(p1, completion, follow_up)
    assert bridged is not None and bridged[: len(p1) + len(completion)] == p1 + completion
    default = PackageRenderer(tok, "qwen3", thinking_retention=None)  # Qwen3's template default
    assert default.bridge_to_next_turn(default.render_ids(prompt), completion, follow_up) is None
    rerendered = default.render_ids(
        [*prompt, {"role": "assistant", "content": "first", "reasoning_content": "plan"}, *follow_up]
    )
    assert rerendered[: len(p1) + len(completion)] != p1 + completion  # the past <think> block was dropped


def test_tool_calls_parse_into_structured_messages_and_malformed_ones_are_reported(tool_tokenizer):
    tok = tool_tokenizer
    renderer = build_renderer("qwen3", tok)
    assert isinstance(renderer, PackageRenderer)
    good = json.dumps({"name": "calc_add", "arguments": {"a": 1, "b": 2}})
    text = f"<think>add</think>ok<tool_call>\n{good}\n</tool_call><tool_call>\n{{oops\n</tool_call><|im_end|>"
    turn = renderer.parse_message(tok.encode(text, add_special_tokens=False), tools=TOOLS)
    assert turn.message["content"] == "ok" and turn.message["reasoning_content"] == "add"
    (call,) = turn.message["tool_calls"]
    assert call["function"] == {"name": "calc_add", "arguments": '{"a": 1, "b": 2}'}
    assert turn.malformed == [{"raw": "{oops", "status": "invalid_json"}]
    prompt = renderer.render_ids([{"role": "user", "content": "1+2"}], TOOLS)
    assert '"name": "calc_add"' in tok.decode(prompt)  # the schema is in the system turn
    assert tool_specs(TOOLS) == TOOLS  # the OpenAI envelope, as chat templates receive it
    assert tool_specs([TOOLS[0]["function"]]) == TOOLS


def test_a_tool_call_spelled_in_byte_pieces_still_parses(tool_tokenizer):
    """Constrained decoding (and an untrained policy) may write `<tool_call>` without its added token."""
    tok = tool_tokenizer
    renderer = build_renderer("qwen3", tok)
    body = "\n" + json.dumps({"name": "calc_add", "arguments": {"a": 1, "b": 2}}) + "\n"
    pieces = [i for ch in "<tool_call>" for i in tok.encode(ch, add_special_tokens=False)]
    ids = pieces + tok.encode(body + "</tool_call>", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<tool_call>") not in ids
    (call,) = renderer.parse_message(ids, tools=TOOLS).message["tool_calls"]
    assert call["function"]["name"] == "calc_add"
