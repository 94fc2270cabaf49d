"""SFT's data: chat conversations from `sft.data_path` or an environment's answers, tokenized and masked for the
trainer's ce loss; the run's SFT output directory. The SFT process itself: primejax/entrypoints/sft.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from primejax.contracts.rundir import RunDir
from primejax.orchestrator.config import EnvConfig
from primejax.sft.data import SftConfig

if TYPE_CHECKING:
    pass

log = logging.getLogger("primejax.sft")


class SFTError(RuntimeError):
    """SFT ran but produced nothing usable (every step non-finite): no model is written."""


def sft_output_dir(root: str | Path) -> Path:
    return RunDir(root).sft_final


def demonstrations_from_env(env_cfg: EnvConfig, n: int) -> list[list[dict]]:
    """Conversations (prompt + the env's reference answer) from an environment whose examples carry answers."""
    from primejax.envs.registry import load_env

    env = load_env(env_cfg.id, dict(env_cfg.args))
    conversations = []
    for i in range(n):
        example = env.example(i)
        if example.answer is None:
            raise ValueError(f"sft.from_env: environment {env_cfg.id!r} has no reference answers to imitate")
        conversations.append([*example.prompt, {"role": "assistant", "content": str(example.answer)}])
    return conversations


def load_conversations(s: SftConfig, envs: dict[str, EnvConfig]) -> list[list[dict]]:
    from primejax.sft.data import read_jsonl

    if s.data_path:
        return list(read_jsonl(s.data_path))
    return demonstrations_from_env(envs[s.from_env], s.num_examples)


def load_samples(s: SftConfig, envs: dict[str, EnvConfig], tokenizer) -> list:
    """Training samples of the SFT data; SFTDataError names `file:line` of a conversation that cannot train."""
    from primejax.sft.data import SFTDataError, conversation_to_sample, read_jsonl_tool_lines

    if not s.data_path:
        return [conversation_to_sample(tokenizer, c, max_len=s.seq_len) for c in load_conversations(s, envs)]
    lines = list(read_jsonl_tool_lines(s.data_path))
    renderer = None
    if any(tools for _, _, tools in lines):  # tool demonstrations: render them as rollouts will be ("auto")
        from primejax.rendering.renderer import build_renderer

        renderer = build_renderer("auto", tokenizer)
    samples = []
    for lineno, conversation, tools in lines:
        try:
            samples.append(
                conversation_to_sample(
                    tokenizer, conversation, max_len=s.seq_len, renderer=renderer, tools=tools
                )
            )
        except Exception as e:  # noqa: BLE001 - the template rejecting a conversation is bad data too
            detail = str(e) if isinstance(e, SFTDataError) else f"{type(e).__name__}: {e}"
            raise SFTDataError(f"{s.data_path}:{lineno}: {detail}") from None
    return samples
