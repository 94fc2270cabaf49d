"""The one module that touches verifiers: a verifiers v1 taskset as a primejax Environment.

verifiers changes its API between minor releases (0.4 kept only `verifiers.v1`), so everything it needs is
here: loading a taskset by id (`vf.load_taskset`), turning its tasks into prompts, and scoring a finished
conversation in process with `await task.score(trace)` against a trace we build from the messages. Its own
rollout machinery (harnesses, runtimes, its train client) is not used: the orchestrator drives the model.

An id with a dot (`my_pkg.my_taskset`) is imported as a module path; verifiers' own loader only resolves
bare package names (`my-taskset` -> `my_taskset` or `verifiers.v1.tasksets.my_taskset`).
"""

from __future__ import annotations

import importlib
from typing import Any

from primejax.envs.base import Environment, Example, Message


def _vf():
    import verifiers.v1 as vf  # deferred: verifiers takes seconds to import and most runs use builtins

    return vf


def _taskset_class(module: Any) -> type:
    """The single Taskset subclass a taskset module exports via `__all__` (verifiers' plugin convention)."""
    vf = _vf()
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    found = {obj for n in names if isinstance(obj := getattr(module, n, None), type)
             and issubclass(obj, vf.Taskset) and obj is not vf.Taskset}
    if len(found) != 1:
        raise TypeError(f"taskset module {module.__name__!r} must export exactly one Taskset subclass, found "
                        f"{sorted(c.__name__ for c in found)}")
    return found.pop()


def load_taskset(taskset_id: str, args: dict[str, Any]) -> Any:
    """A verifiers taskset by id, its TasksetConfig built from `args` (validated by verifiers' pydantic model)."""
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type

    if "." in taskset_id:
        cls = _taskset_class(importlib.import_module(taskset_id))
        config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        return cls(config_cls.model_validate({**args, "id": taskset_id}))
    config_cls = vf.taskset_config_type(taskset_id)
    return vf.load_taskset(config_cls.model_validate({**args, "id": taskset_id}))


def _to_dict(message: Any) -> Message:
    return message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)


class VerifiersEnv(Environment):
    """Single-turn verifiers tasks: the task's prompt goes to the model, its `@vf.reward`s score the reply."""

    def __init__(self, taskset_id: str, num_examples: int | None = None, **taskset_args: Any):
        taskset = load_taskset(taskset_id, taskset_args)
        if num_examples is not None:
            taskset = taskset.take(num_examples)
        elif not taskset.bounded:
            raise ValueError(f"taskset {taskset_id!r} is infinite: set args.num_examples")
        self.taskset_id = taskset_id
        self.tasks = list(taskset)
        if not self.tasks:
            raise ValueError(f"taskset {taskset_id!r} yielded no tasks")
        self.num_examples = len(self.tasks)
        self._message = None

    def example(self, index: int) -> Example:
        data = self.tasks[index].data
        prompt: list[Message] = []
        if data.system_prompt:
            prompt.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            prompt.append({"role": "user", "content": data.prompt})
        elif data.prompt:
            prompt.extend(_to_dict(m) for m in data.prompt)
        return Example(key=f"{self.taskset_id}/{self.tasks[index].key}", prompt=prompt, info={"index": index})

    def _trace(self, task: Any, example: Example, messages: list[Message]) -> Any:
        vf = _vf()
        from pydantic import TypeAdapter
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, TraceTask

        if self._message is None:
            self._message = TypeAdapter(vf.Message)
        num_prompt = len(example.prompt)
        nodes = [
            MessageNode(parent=i - 1 if i else None, message=self._message.validate_python(m),
                        sampled=i >= num_prompt and m.get("role") == "assistant")
            for i, m in enumerate(messages)
        ]
        return vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                        agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes, is_completed=True, ok=True)

    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        task = self.tasks[example.info["index"]]
        trace = self._trace(task, example, messages)
        await task.score(trace)
        state["reward_components"] = {k: r.score for k, r in trace.rewards.items() if r is not None}
        return float(trace.reward)


def load(taskset_id: str, **args: Any) -> VerifiersEnv:
    return VerifiersEnv(taskset_id, **args)
