"""Test doubles: an inference client that answers instantly from a script, a fake clock."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from ml_collections import ConfigDict
from safetensors.numpy import save_file

from primejax.config import default_config
from primejax.transports.weights.filesystem.broadcast import write_broadcast


@dataclass
class FakeCompletion:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str
    text: str = ""


def last_user_text(prompt: str) -> str:
    start = prompt.rfind("<|im_start|>user\n") + len("<|im_start|>user\n")
    return prompt[start : prompt.find("<|im_end|>", start)]


def reverse_reply(prompt: str, member: int) -> str:
    """Member 0 reverses the text exactly, member i drops i characters: distinct rewards in every group."""
    target = last_user_text(prompt)[::-1]
    return target[: max(0, len(target) - member)] or "?"


class FakeClock:
    """Virtual time: `sleep(dt)` advances it and yields to the loop in proportion to dt, so relative speeds
    of simulated processes are fixed by their sleeps, not by the machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    async def sleep(self, dt: float) -> None:
        self.now += dt
        for _ in range(max(1, round(dt * 10))):
            await asyncio.sleep(0)


class FakeClient:
    """Answers `generate` with `tokenizer.encode(reply)` + <|im_end|>, `reply` chosen by `replies(prompt_text,
    member)`; records the served version of every request and each weight update."""

    def __init__(self, tokenizer: Any, replies=None, clock: FakeClock | None = None, gen_time: float = 0.0):
        self.tokenizer = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.replies = replies or reverse_reply
        self.clock, self.gen_time = clock, gen_time
        self.served_version = 0
        self.served: list[int] = []  # version at each generate call
        self.updates: list[tuple[str, int]] = []
        self.requests: list[dict] = []

    async def generate(
        self, prompt_token_ids, *, n, max_tokens, temperature, top_p=1.0, stop=None, seed=None
    ):
        self.served.append(self.served_version)
        self.requests.append({"prompt": list(prompt_token_ids), "n": n, "seed": seed})
        if self.clock is not None and self.gen_time:
            await self.clock.sleep(self.gen_time)
        prompt = self.tokenizer.decode(prompt_token_ids)
        out = []
        for member in range(n):
            ids = self.tokenizer.encode(self.replies(prompt, member), add_special_tokens=False)[
                : max_tokens - 1
            ]
            ids = ids + [self.eos]
            out.append(FakeCompletion(list(prompt_token_ids), ids, [-0.25] * len(ids), "stop"))
        return out

    async def update_weights(self, weight_dir: str, version: int) -> None:
        self.updates.append((weight_dir, version))
        self.served_version = version

    async def weights_version(self) -> int:
        return self.served_version


def small_config(
    run_dir, *, env_id: str = "reverse-text", batch_size: int = 8, group_size: int = 4, **orchestrator: Any
) -> ConfigDict:
    cfg = default_config()
    cfg.run.output_dir = str(run_dir.parent)
    cfg.run.name = run_dir.name
    cfg.model.path = "unused"
    o = cfg.orchestrator
    o.envs.reverse_text.id = env_id
    o.batch_size, o.group_size = batch_size, group_size
    o.seq_len, o.max_prompt_tokens = 256, 128
    o.sampling.max_tokens = 32
    o.weights_poll_s = 0.1
    o.async_level = 8  # no trainer in most tests: never wait for weights unless a test sets it
    for key, value in orchestrator.items():
        o[key] = value
    return cfg


def make_orchestrator(cfg: ConfigDict, **kwargs: Any):
    """An Orchestrator from a whole test config, wired as `primejax.orchestrator.run` wires it."""
    from primejax.config import typed
    from primejax.orchestrator.loop import Orchestrator

    c = typed(cfg)
    return Orchestrator(
        c.orchestrator,
        seed=c.run.seed,
        num_shards=c.trainer.distributed.num_processes,
        pad_rows_to_multiple=c.trainer.micro_batch_size,
        recovery_timeout_s=2 * c.inference.startup_timeout_s,
        **kwargs,
    )


def fake_broadcast(run_dir: Path, step: int) -> None:
    """A fake trainer's broadcast of step `step`: a config.json and one small .safetensors file, the least the
    orchestrator's STABLE-manifest check accepts (a directory without weights is refused and retried)."""

    def write(d: Path) -> None:
        (d / "config.json").write_text(json.dumps({"step": step}))
        save_file({"step": np.full((1,), step, np.float32)}, str(d / "model.safetensors"))

    write_broadcast(run_dir, step, write)
