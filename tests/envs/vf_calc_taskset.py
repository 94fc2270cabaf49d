"""A small tool-using verifiers v1 taskset: compute a sum or product with a calculator toolset.

Exercises what the in-process driver must honour: tools advertised as `calc_<tool>`, toolset state (instance
attributes and the rollout's `State`) kept across calls, the three stop kinds (`Response`: the reply says
STOP; `Trace`: the calculator was called `max_calls` times; `Request`: a tool result of 666 is about to go
back to the model), a reward and a metric. Shared by the tests and the tool-use demo.
"""

from __future__ import annotations

import random

import verifiers.v1 as vf

OPS = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}
SYSTEM = "Use the calculator tools to answer. Reply with only the final number."


class CalcState(vf.State):
    calls: int = 0


class CalcData(vf.TaskData):
    answer: str = ""
    op: str = "add"
    a: int = 0
    b: int = 0


class CalcToolsetConfig(vf.ToolsetConfig):
    pass


class Calculator(vf.Toolset[CalcToolsetConfig, CalcState]):
    TOOL_PREFIX = "calc"

    def __init__(self, config: CalcToolsetConfig) -> None:
        super().__init__(config)
        self.history: list[str] = []  # per-rollout instance state

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        self.state.calls += 1
        self.history.append(f"add {a} {b}")
        return str(a + b)

    @vf.tool
    async def mul(self, a: int, b: int) -> str:
        """Multiply two integers."""
        self.state.calls += 1
        self.history.append(f"mul {a} {b}")
        return str(a * b)

    @vf.tool
    async def history_len(self) -> str:
        """How many calculations this rollout made (instance history, State counter)."""
        return f"{len(self.history)} {self.state.calls}"


class CalcTaskConfig(vf.TaskConfig):
    max_calls: int = 3


class CalcTask(vf.Task[CalcData, CalcState, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [Calculator(CalcToolsetConfig())]

    @vf.stop
    async def said_stop(self, response: vf.Response) -> bool:
        return "STOP" in (response.message.content or "")

    @vf.stop
    async def too_many_calls(self, trace: vf.Trace) -> bool:
        return trace.state.calls >= self.config.max_calls

    @vf.stop
    async def forbidden_result(self, request: vf.Request) -> bool:
        last = request.messages[-1]
        return last.role == "tool" and last.content == "666"

    @vf.reward
    async def correct(self, trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def used_tool(self, trace) -> float:
        return float(bool(trace.tool_messages))


class CalcTasksetConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()
    size: int = 16
    seed: int = 0


class CalcTaskset(vf.Taskset[CalcTask, CalcTasksetConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.size):
            op, a, b = rng.choice(sorted(OPS)), rng.randint(2, 40), rng.randint(2, 40)
            word = "sum" if op == "add" else "product"
            yield CalcTask(
                CalcData(
                    prompt=f"What is the {word} of {a} and {b}?",
                    system_prompt=SYSTEM,
                    answer=str(OPS[op](a, b)),
                    op=op,
                    a=a,
                    b=b,
                ),
                self.config.task,
            )


__all__ = ["CalcTaskset"]


if __name__ == "__main__":  # verifiers' own loop serves each toolset as `python -m <its module>`
    Calculator.run()
