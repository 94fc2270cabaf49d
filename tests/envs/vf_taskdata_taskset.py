"""A toolset written against verifiers' contract: `setup_task` receives the rollout's `TaskData` (what verifiers'
tool servers fetch from the state channel), so it reads the data's own fields."""

from __future__ import annotations

import verifiers.v1 as vf


class SecretData(vf.TaskData):
    secret: str


class SecretToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "vault"

    async def setup_task(self, task) -> None:
        self.secret, self.name = task.secret, task.name  # TaskData fields (a Task has neither)

    @vf.tool
    async def open(self) -> str:
        """Open the vault."""
        return f"{self.name}:{self.secret}"


class SecretTask(vf.Task[SecretData]):
    @classmethod
    def toolsets(cls, config) -> list[vf.Toolset]:
        return [SecretToolset(vf.ToolsetConfig())]

    @vf.reward
    async def told(self, trace: vf.Trace) -> float:
        return float(self.data.secret in trace.last_reply)


class SecretTaskset(vf.Taskset[SecretTask, vf.TasksetConfig]):
    def load(self) -> list[SecretTask]:
        return [
            SecretTask(
                SecretData(idx=i, name=f"v{i}", prompt="Open the vault and say what is inside.", secret=s)
            )
            for i, s in enumerate(["ruby", "opal"])
        ]


__all__ = ["SecretTaskset"]
