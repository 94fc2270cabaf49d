"""Environments the env-worker tests load by import path (`worker_envs:<loader>`) in worker processes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from primejax.envs.base import Environment, Example, Message, completion_text
from primejax.envs.reverse_text import ReverseText


class HangOnce(ReverseText):
    """reverse-text whose scoring blocks its process (a reward stuck in a C call: no await, no cancel) the first
    time any worker scores; `marker` is the file that says it happened. Declares itself CPU-heavy, so the
    default `env_workers.num` (-1, auto) runs it in workers."""

    cpu_heavy = True

    def __init__(self, marker: str, **kw: Any):
        super().__init__(**kw)
        self.marker = Path(marker)

    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        try:
            self.marker.open("x").close()
        except FileExistsError:
            return await super().score(example, messages, state)
        time.sleep(3600)
        return 0.0


class Counter:
    """A live object the rollout keeps in the worker between its calls (not JSON: it never crosses)."""

    def __init__(self) -> None:
        self.calls = 0


class ToolEpisode(Environment):
    """Drives its own episode: two model calls with a 'tool' answer between them, computed where the env runs."""

    drives_rollout = True
    max_turns = 4
    num_examples = 100

    def example(self, index: int) -> Example:
        return Example(key=f"tool/{index}", prompt=[{"role": "user", "content": f"count {index}"}])

    async def rollout(self, example: Example, state: dict[str, Any], model: Any) -> list[Message]:
        state["live"] = Counter()
        state["env_pid"] = os.getpid()
        messages = list(example.prompt)
        for turn in range(2):
            reply = await model(messages)
            state["live"].calls += 1
            # what the orchestrator notes after each model call reaches the env (as in process)
            state["seen_output_tokens"] = state.get("output_tokens")
            messages = [*messages, reply, {"role": "user", "content": f"tool says {turn} from {os.getpid()}"}]
        return messages[:-1]

    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        state["score_pid"] = os.getpid()
        return float(state["live"].calls) + (1.0 if completion_text(messages) else 0.0)


def load_hang_once(marker: str, **args: Any) -> HangOnce:
    return HangOnce(marker, **args)


def load_tool_episode(**_: Any) -> ToolEpisode:
    return ToolEpisode()


class ProtocolWriter(ReverseText):
    """reverse-text whose scoring first writes `lines` straight into the worker's protocol pipe (a hostile or
    careless env that found it: the pipe to the parent is the worker's one writable FIFO besides stdin)."""

    def __init__(self, lines: list[str], **kw: Any):
        super().__init__(**kw)
        self.lines = lines

    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        import fcntl
        import stat

        for fd in range(3, 64):
            try:
                st, flags = os.fstat(fd), fcntl.fcntl(fd, fcntl.F_GETFL)
            except OSError:
                continue
            if stat.S_ISFIFO(st.st_mode) and flags & os.O_ACCMODE == os.O_WRONLY:
                for line in self.lines:
                    os.write(fd, line.encode() + b"\n")
                break
        else:
            raise RuntimeError("the protocol pipe was not found")
        return await super().score(example, messages, state)


def load_protocol_writer(lines: list[str], **args: Any) -> ProtocolWriter:
    return ProtocolWriter(lines, **args)
