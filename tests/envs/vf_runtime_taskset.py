"""A verifiers v1 taskset whose reward needs the rollout's runtime (it runs a command there): the in-process
driver has no runtime, so `driver = "auto"` must choose verifiers' own loop for it."""

from __future__ import annotations

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str = ""


class RuntimeEchoTask(vf.Task[EchoData]):
    @vf.reward
    async def echoed_in_runtime(self, trace, runtime) -> float:
        result = await runtime.run(["echo", self.data.answer], {})
        return float(result.stdout.strip() == trace.last_reply.strip())


class RuntimeEchoTaskset(vf.Taskset[RuntimeEchoTask, vf.TasksetConfig]):
    def load(self):
        for word in ("apple", "river"):
            yield RuntimeEchoTask(EchoData(prompt=f"Say {word}", answer=word), self.config.task)


__all__ = ["RuntimeEchoTaskset"]
