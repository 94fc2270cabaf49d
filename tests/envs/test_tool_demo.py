"""The tool-use demo's tokenizer (tools/demo_tool_use.py): the same rendering in far fewer tokens, and the
renderer still parses the demonstrations' tool calls. The demo itself (SFT + RL on vLLM, minutes) is not run
here; docs/verifiers.md has its command and numbers."""

from __future__ import annotations

import json

import pytest

from primejax.envs.registry import load_env
from primejax.models.tiny import build_tokenizer
from primejax.rendering.renderer import build_renderer, parse_message
from primejax.sft.data import conversation_to_sample
from tools.demo_tool_use import demonstrations, tokenizer_spec


def _samples(tok, rows):
    renderer = build_renderer("auto", tok)
    return renderer, [
        conversation_to_sample(tok, r["messages"], renderer=renderer, tools=r["tools"]) for r in rows
    ]


def _trained_text(tok, sample) -> str:
    return tok.decode([t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m])


def test_demo_tokenizer_renders_the_same_text_in_a_tenth_of_the_tokens(tmp_path):
    rows = demonstrations(8, seed=1, args={"max_operand": 9})
    corpus, extra = tokenizer_spec(rows)
    assert len(extra) >= 5 and any("<tools></tools>" in line for line in extra)  # the preamble's lines
    compact = build_tokenizer(
        tmp_path / "compact", vocab_size=512, corpus=corpus, tool_tokens=True, extra_tokens=extra
    )
    default = build_tokenizer(tmp_path / "default", tool_tokens=True)
    renderer, short = _samples(compact, rows)
    _, long = _samples(default, rows)
    for s, ref in zip(short, long, strict=True):
        # the same conversation through the same template, in far fewer tokens
        assert compact.decode(s.token_ids) == default.decode(ref.token_ids)
        assert len(s.token_ids) * 8 < len(ref.token_ids)
        # the loss is on the assistant turns in both: the completions, tokenized differently
        assert _trained_text(compact, s) == _trained_text(default, ref)
    for line in extra:  # each constant line of the preamble is one token
        assert len(compact.encode(line, add_special_tokens=False)) == 1

    # The first assistant turn of a demonstration parses back into its tool call (the renderer finds
    # `<tool_call>` by token id, so the added tokens must not swallow it).
    row = rows[0]
    prompt = renderer.render_ids(row["messages"][:2], row["tools"])
    completion = compact.encode(
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "calc_add", "arguments": '
        '{"a": 3, "b": 4}}\n</tool_call><|im_end|>',
        add_special_tokens=False,
    )
    message, malformed = parse_message(renderer, completion, prompt, row["tools"])
    assert malformed == []
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "calc_add"
    assert json.loads(call["function"]["arguments"]) == {"a": 3, "b": 4}


def test_require_tool_scores_only_answers_computed_with_the_calculator(tmp_path):
    from transformers import AutoTokenizer

    from tests.envs.test_verifiers_driver import TASKSET, call, run_group

    build_tokenizer(tmp_path, tool_tokens=True)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    env = load_env(TASKSET, {"size": 2, "max_operand": 9})
    data = env.tasks[0].data
    guessed = [data.answer]  # the right number, no tool call
    computed = [call(f"calc_{data.op}", a=data.a, b=data.b), data.answer]
    for require, script, reward in ((False, guessed, 1.0), (True, guessed, 0.0), (True, computed, 1.0)):
        rollout, *_ = run_group(tok, script, max_operand=9, require_tool=require)
        assert rollout.ok and rollout.reward == reward, (require, script, rollout.reward)


def test_direct_every_mixes_answers_without_a_tool_call_into_the_demonstrations():
    rows = demonstrations(6, seed=1, args={"max_operand": 9}, direct_every=2)
    env = load_env("tests.envs.vf_calc_taskset", {"size": 6, "seed": 1, "max_operand": 9})
    for i, row in enumerate(rows):
        data = env.tasks[i].data
        assistant = [m for m in row["messages"] if m["role"] == "assistant"]
        assert assistant[-1]["content"] == data.answer  # every demonstration is solved
        if i % 2 == 0:  # answered straight away: one turn, no tool call
            assert len(assistant) == 1 and not assistant[0].get("tool_calls")
        else:  # the right calculator tool on the question's operands, then its result
            [call] = assistant[0]["tool_calls"]
            assert call["function"]["name"] == f"calc_{data.op}"
            assert json.loads(call["function"]["arguments"]) == {"a": data.a, "b": data.b}
        assert row["tools"]  # the tool schemas are rendered either way
    assert all(r["messages"][-2]["role"] == "tool" for r in demonstrations(4, seed=1, direct_every=0))


def test_negative_direct_every_is_one_clear_error(capsys):
    from tools.demo_tool_use import main

    with pytest.raises(SystemExit) as e:
        main(["--direct-every", "-1"])
    assert e.value.code == 2
    assert "--direct-every -1: 0 (every demonstration calls the tool) or a positive k" in capsys.readouterr().err
