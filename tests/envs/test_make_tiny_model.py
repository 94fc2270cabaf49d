"""`build_tiny_model(..., tool_tokens=True)` (`python -m tools.make_tiny_model OUT --tool-tokens`): the tokenizer carries Qwen3's tool-call tokens, each one
token (a tool-using taskset's calls are written and parsed by them); without the flag it does not."""

from __future__ import annotations

from transformers import AutoTokenizer

from primejax.models.tiny import build_tiny_model

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def test_tool_tokens_flag(tmp_path):
    build_tiny_model(tmp_path / "tools", tool_tokens=True)
    build_tiny_model(tmp_path / "plain")
    with_tools = AutoTokenizer.from_pretrained(str(tmp_path / "tools"))
    plain = AutoTokenizer.from_pretrained(str(tmp_path / "plain"))
    for token in TOOL_TOKENS:
        assert len(with_tools.encode(token, add_special_tokens=False)) == 1, token
        assert token not in plain.get_vocab()
