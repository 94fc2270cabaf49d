"""A small local verifiers v1 taskset for the adapter test: echo a word back, rewarded by two @vf.rewards."""

from __future__ import annotations

import verifiers.v1 as vf

WORDS = ("apple", "river", "stone")


class EchoData(vf.TaskData):
    answer: str = ""


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def exact(self, trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def mentions(self, trace) -> float:
        return float(self.data.answer in trace.last_reply)


class EchoTasksetConfig(vf.TasksetConfig):
    prefix: str = "Say"


class EchoTaskset(vf.Taskset[EchoTask, EchoTasksetConfig]):
    def load(self):
        for word in WORDS:
            yield EchoTask(
                EchoData(prompt=f"{self.config.prefix} {word}", system_prompt="Be brief.", answer=word),
                self.config.task,
            )


__all__ = ["EchoTaskset"]
