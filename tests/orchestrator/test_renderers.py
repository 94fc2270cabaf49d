"""Renderers: the hand-written qwen3 renderer keeps the extension property where a Qwen3-style chat template
(which strips past <think> blocks) breaks it, and `auto` picks it for a ChatML tokenizer with think tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from primejax.envs.base import Example
from primejax.orchestrator.rollout import Rollout, TrajectoryStep
from primejax.orchestrator.samples import rollout_to_samples
from primejax.rendering.qwen3_renderer import Qwen3Renderer
from primejax.rendering.renderer import ChatTemplateRenderer, build_renderer, detect_renderer

# Like Qwen3's template: assistant turns before the last user turn lose their <think>...</think> block.
STRIPPING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def stripping_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from primejax.models.tiny import build_tokenizer

    out: Path = tmp_path_factory.mktemp("qwen3-like")
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = STRIPPING_TEMPLATE
    return tok


def conversation(renderer, tokenizer, turns: int = 3) -> Rollout:
    """A rollout as the generator builds it: every turn answers with a think block, then a user turn arrives."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "U1"}]
    steps: list[TrajectoryStep] = []
    prompt = renderer.render_ids(messages)
    for t in range(turns):
        completion = tokenizer.encode(f"<think>R{t}</think>A{t}", add_special_tokens=False) + [eos]
        steps.append(TrajectoryStep(prompt, completion, [-0.1] * len(completion), "stop", 0))
        messages.append({"role": "assistant", "content": renderer.parse_response(completion)})
        new = [{"role": "user", "content": f"U{t + 2}"}]
        messages += new
        prompt = renderer.bridge_to_next_turn(steps[-1].prompt_ids, completion, new) or renderer.render_ids(
            messages
        )
    r = Rollout(
        env="e",
        example_index=0,
        example=Example("k", messages[:1]),
        group_id=0,
        messages=messages,
        steps=steps,
        reward=1.0,
    )
    r.assign_advantages(1.0)
    return r


def test_chat_template_strips_think_and_breaks_extension_on_every_turn(stripping_tokenizer):
    tok = stripping_tokenizer
    r = conversation(ChatTemplateRenderer(tok), tok)
    text = tok.decode(r.steps[1].prompt_ids)
    assert "<think>" not in text and "A0" in text  # the stripped history
    assert len(rollout_to_samples(r, "rl", 1.0, 1024)) == 3


def test_qwen3_renderer_keeps_think_blocks_and_extension(stripping_tokenizer):
    tok = stripping_tokenizer
    r = conversation(Qwen3Renderer(tok), tok)
    assert "<think>R0</think>A0" in tok.decode(r.steps[2].prompt_ids)
    (sample,) = rollout_to_samples(r, "rl", 1.0, 1024)  # one sample: every turn extends the last
    assert sample.token_ids == r.steps[-1].prompt_ids + r.steps[-1].completion_ids
    assert sum(sample.loss_mask) == sum(len(s.completion_ids) for s in r.steps)


def test_qwen3_first_turn_matches_the_chat_template_and_bridge_closes_truncated_turns(tokenizer):
    renderer = Qwen3Renderer(tokenizer)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}]
    assert renderer.render_ids(messages) == ChatTemplateRenderer(tokenizer).render_ids(messages)
    truncated = tokenizer.encode("<think>long", add_special_tokens=False)  # hit max_tokens: no <|im_end|>
    ids = renderer.bridge_to_next_turn([1, 2], truncated, [{"role": "user", "content": "U2"}])
    assert ids[: 2 + len(truncated)] == [1, 2, *truncated]
    assert (
        tokenizer.decode(ids[2 + len(truncated) :])
        == "<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n"
    )
    tool = renderer.bridge_to_next_turn([1], [renderer.im_end], [{"role": "tool", "content": "42"}])
    assert (
        tokenizer.decode(tool[2:])
        == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert renderer.bridge_to_next_turn([1], [2], [{"role": "assistant", "content": "x"}]) is None
    parsed = renderer.parse(
        tokenizer.encode("<think> plan </think>answer<tool_call>{}</tool_call>", add_special_tokens=False)
    )
    assert (parsed.reasoning_content, parsed.content, parsed.tool_calls) == ("plan", "answer", ["{}"])


def test_auto_picks_qwen3_for_chatml_with_think_tokens_else_the_template(tokenizer, stripping_tokenizer):
    assert detect_renderer(tokenizer) == "qwen3"
    assert isinstance(build_renderer("auto", stripping_tokenizer), Qwen3Renderer)
    assert isinstance(build_renderer("default", tokenizer), ChatTemplateRenderer)
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        assert detect_renderer(tokenizer) == "default"
    finally:
        tokenizer.chat_template = original
    with pytest.raises(KeyError, match="unknown renderer"):
        build_renderer("nope", tokenizer)
