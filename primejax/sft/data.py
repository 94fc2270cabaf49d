"""SFT data: chat JSONL -> training samples with the loss on assistant tokens only.

Each JSONL line is either `{"messages": [{"role": ..., "content": ...}, ...]}` or
`{"prompt": str | messages, "completion": str | messages}`. Token ids come from the tokenizer's chat template;
an assistant message's tokens are found by rendering the conversation up to that message with
`add_generation_prompt=True` (its prefix) and through it (its end), so whatever the template puts around a
turn, exactly the tokens the model must produce (content + end-of-turn) carry the loss. Samples become
`TrainingSample`s on the ce component only (`ce_weights` 1.0 on assistant tokens, rl weight 0).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from primejax.contracts.batch import TrainingSample
from primejax.utils.io import atomic_write_text
from primejax.utils.sections import MAX_ROWS, MAX_STEPS, MAX_TOKENS, ConfigError, Section, option, section


@section
class SftConfig(Section):
    """`sft`: supervised fine-tuning (`python -m primejax.sft`, or a warm-up before RL when steps > 0)."""

    data_path: str = option("", "chat JSONL ({'messages': [...]} or {'prompt', 'completion'} per line)")
    from_env: str = option("", "or: demonstrations from this orchestrator.envs entry's reference answers")
    num_examples: int = option(2048, "demonstrations generated with from_env", gt=0, le=MAX_STEPS)
    steps: int = option(0, "SFT steps; 0 = no warm-up", ge=0, le=MAX_STEPS)
    batch_size: int = option(64, "conversations per step", gt=0, le=MAX_ROWS)
    lr: float = option(1e-3, "constant learning rate", ge=0)
    seq_len: int = option(256, "packed row length", gt=0, le=MAX_TOKENS)
    warmup_lora: bool = option(
        True,
        "with model.lora, the warm-up before RL trains adapters too (RL then adapts the merged SFT model); False: "
        "the warm-up fine-tunes every weight, RL trains adapters on its result",
    )

    def check(self) -> None:
        if self.steps > 0 and not self.lr > 0:
            raise ConfigError("lr", f"must be > 0 when sft.steps > 0, got {self.lr}")


Message = dict[str, Any]


class SFTDataError(ValueError):
    pass


def _as_messages(value: Any, role: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        for i, m in enumerate(value):
            if not isinstance(m.get("role"), str):
                raise SFTDataError(f"message {i} has no string 'role'")
            if not isinstance(m.get("content"), str):
                raise SFTDataError(
                    f"message {i} ({m['role']}): 'content' must be a string, got "
                    f"{type(m.get('content')).__name__}"
                )
        return value
    raise SFTDataError(f"expected a string or a non-empty list of messages, got {type(value).__name__}")


def _conversation(row: Any) -> list[Message]:
    if not isinstance(row, dict):
        raise SFTDataError(f"a line must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        return _as_messages(row["messages"], "user")
    if "prompt" not in row or "completion" not in row:
        raise SFTDataError("needs 'messages', or 'prompt' and 'completion'")
    return _as_messages(row["prompt"], "user") + _as_messages(row["completion"], "assistant")


def read_jsonl_lines(path: str | Path) -> Iterator[tuple[int, list[Message]]]:
    """Yield (line number, conversation) of each line; a malformed line is an error naming `file:line`."""
    for lineno, messages, _ in read_jsonl_tool_lines(path):
        yield lineno, messages


def read_jsonl_tool_lines(path: str | Path) -> Iterator[tuple[int, list[Message], list[dict] | None]]:
    """Like `read_jsonl_lines`, with each line's optional `tools` (the schemas its conversation uses)."""
    path = Path(path)
    if not path.is_file():
        raise SFTDataError(f"{path}: no such SFT data file")
    found = False
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SFTDataError(f"{path}:{lineno}: not UTF-8 text (byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                messages = _conversation(row)
                tools = row.get("tools")
                if tools is not None and not isinstance(tools, list):
                    raise SFTDataError("'tools' must be a list of tool schemas")
            except json.JSONDecodeError as e:
                raise SFTDataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            except RecursionError:  # json's decoder recurses per nesting level
                raise SFTDataError(f"{path}:{lineno}: nests too deeply to be an SFT example") from None
            except SFTDataError as e:
                raise SFTDataError(f"{path}:{lineno}: not an SFT example ({e})") from None
            if not any(m["role"] == "assistant" for m in messages):
                raise SFTDataError(f"{path}:{lineno}: no assistant message to train on")
            found = True
            yield lineno, messages, tools
    if not found:
        raise SFTDataError(f"{path}: no SFT examples (the file is empty)")


def read_jsonl(path: str | Path) -> Iterator[list[Message]]:
    """Yield each line's conversation; a malformed line is an error naming the file and line number."""
    for _, messages in read_jsonl_lines(path):
        yield messages


def _render(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if hasattr(ids, "keys"):  # transformers >= 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def conversation_to_sample(
    tokenizer: Any,
    messages: list[Message],
    max_len: int | None = None,
    *,
    renderer: Any = None,
    tools: list[dict] | None = None,
) -> TrainingSample:
    """Token ids of the whole conversation with loss on every assistant turn.

    With a renderers-package `renderer` (rendering/renderers_adapter.py), the conversation and its `tools`
    are built exactly as a rollout of it would be (see `_rendered_like_a_rollout`)."""
    if renderer is not None:
        return _rendered_like_a_rollout(tokenizer, renderer, messages, tools, max_len)
    if getattr(tokenizer, "chat_template", None) is None:
        raise SFTDataError("the tokenizer has no chat template")
    full = _render(tokenizer, messages, generation_prompt=False)
    mask = [False] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], generation_prompt=True))
        end = len(_render(tokenizer, messages[: i + 1], generation_prompt=False))
        # Trailing template whitespace after the end-of-turn token is not something the model must emit.
        while end > start and tokenizer.decode([full[end - 1]]).strip() == "":
            end -= 1
        for t in range(max(start, 1), end):
            mask[t] = True
    if max_len is not None and len(full) > max_len:
        raise SFTDataError(f"a conversation has {len(full)} tokens, more than sft.seq_len = {max_len}")
    return TrainingSample(
        token_ids=full,
        loss_mask=mask,
        inference_logprobs=[0.0] * len(full),
        ce_weights=[1.0 if m else 0.0 for m in mask],
    )


def _rendered_like_a_rollout(
    tokenizer: Any, renderer: Any, messages: list[Message], tools: list[dict] | None, max_len: int | None
) -> TrainingSample:
    """Each assistant turn is the completion the model would sample (the renderer's rendering of that message
    after the generation prompt, e.g. Qwen3's empty `<think></think>` included), and each later prompt extends
    the previous prompt + completion with the new messages (`bridge_to_next_turn`), as the rollout loop does:
    the model learns exactly the ids it will later be asked to produce."""
    tokens: list[int] = []
    mask: list[bool] = []
    last, prev_prompt, prev_completion = -1, [], []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        history = renderer.render_ids(messages[:i], tools)
        full = renderer.render_conversation_ids(messages[: i + 1], tools)
        if full[: len(history)] != history:
            raise SFTDataError(f"assistant message {i}: the renderer re-renders history when it is appended")
        completion = full[len(history) :]
        while completion and tokenizer.decode([completion[-1]]).strip() == "":
            completion = completion[:-1]  # template whitespace after the end-of-turn token is not sampled
        if not tokens:
            prompt = history
        else:
            prompt = renderer.bridge_to_next_turn(prev_prompt, prev_completion, messages[last + 1 : i], tools)
            if prompt is None:
                raise SFTDataError(f"assistant message {i}: the renderer cannot extend the previous turn")
        new = prompt[len(tokens) :]
        tokens += new + completion
        mask += [False] * len(new) + [True] * len(completion)
        prev_prompt, prev_completion, last = prompt, completion, i
    if mask:
        mask[0] = False
    if max_len is not None and len(tokens) > max_len:
        raise SFTDataError(f"a conversation has {len(tokens)} tokens, more than sft.seq_len = {max_len}")
    return TrainingSample(
        token_ids=tokens,
        loss_mask=mask,
        inference_logprobs=[0.0] * len(tokens),
        ce_weights=[1.0 if m else 0.0 for m in mask],
    )


def write_jsonl(path: str | Path, conversations: Iterable[list[Message]]) -> Path:
    """Write conversations as `{"messages": ...}` lines, atomically."""
    text = "".join(json.dumps({"messages": m}) + "\n" for m in conversations)
    atomic_write_text(path, text)
    return Path(path)
