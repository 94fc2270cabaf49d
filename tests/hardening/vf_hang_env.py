"""A verifiers v1 taskset with the Env it ships, one of whose episodes in two hangs where `hang_at` says: in the
Env's `setup`, in its `run` between two agent turns (the env's step: the user's next message never comes), in
the task's reward when the interaction closes (a judge that never answers), in both of the last two (the close
runs while the step's cancellation unwinds), or in the Env's `finalize`. A hang
is an `asyncio.Event` nobody sets, as a stuck network call or subprocess looks to the event loop."""

from __future__ import annotations

import asyncio
import itertools

import verifiers.v1 as vf

WORDS = ("apple", "river", "stone")


async def never() -> None:
    await asyncio.Event().wait()


class HangData(vf.TaskData):
    answer: str = ""
    hang: bool = False


class HangTask(vf.Task[HangData]):
    @vf.reward
    async def said(self, trace) -> float:
        if self.data.hang:
            await never()
        return float(self.data.answer in trace.last_reply)


class HangTaskset(vf.Taskset[HangTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS:
            yield HangTask(HangData(prompt=f"Say {word}", answer=word), self.config.task)


class HangEnvConfig(vf.EnvConfig):
    assistant: vf.AgentConfig = vf.AgentConfig()
    hang_at: str = ""  # setup | step | score | finalize | step_then_score (hangs again while unwinding)


class HangEnv(vf.Env[HangEnvConfig]):
    def _hangs(self, where: str) -> bool:
        """Every other call of the stage `hang_at` names hangs (episodes run concurrently: no per-episode state
        on the env)."""
        calls = self.__dict__.setdefault("_calls", itertools.count())
        return self.config.hang_at == where and next(calls) % 2 == 1

    async def setup(self, agents) -> None:
        if self._hangs("setup"):
            await never()

    async def run(self, task, agents) -> None:
        at = self.config.hang_at
        hang = self._hangs(at) if at in ("step", "score", "step_then_score") else False
        data = task.data.model_copy(
            update={"prompt": None, "hang": hang and at in ("score", "step_then_score")}
        )
        async with agents.assistant.interaction(type(task)(data, task.config)) as assistant:
            await assistant.turn(task.data.prompt)
            if hang and at in ("step", "step_then_score"):
                await never()
            await assistant.turn("Once more.")

    async def finalize(self, task, episode) -> None:
        if self._hangs("finalize"):
            await never()


__all__ = ["HangEnv", "HangTaskset"]
