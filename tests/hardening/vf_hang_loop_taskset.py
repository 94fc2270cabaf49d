"""A verifiers v1 taskset that verifiers' own loop must drive (its reward runs a command in the rollout's
runtime) and whose scoring of the word "river" never answers: an `asyncio.Event` nobody sets, as a judge whose
connection stalled looks to the event loop."""

from __future__ import annotations

import asyncio

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str = ""


class HangingJudgeTask(vf.Task[EchoData]):
    @vf.reward
    async def echoed_in_runtime(self, trace, runtime) -> float:
        if self.data.answer == "river":
            await asyncio.Event().wait()
        result = await runtime.run(["echo", self.data.answer], {})
        return float(result.stdout.strip() == trace.last_reply.strip())


class HangingJudgeTaskset(vf.Taskset[HangingJudgeTask, vf.TasksetConfig]):
    def load(self):
        for word in ("apple", "river"):
            yield HangingJudgeTask(EchoData(prompt=f"Say {word}", answer=word), self.config.task)


__all__ = ["HangingJudgeTaskset"]
