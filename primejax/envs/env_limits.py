"""Limits per environment (`orchestrator.envs.<name>.limits`): so one slow environment does not starve another.

In a multi-env run every env shares the orchestrator's request slots (`orchestrator.max_concurrent`). An env
whose episodes are slow (a sandbox, a judge, verifiers' own loop or env server, whose whole episode holds a
request slot) can otherwise take every slot and leave the others waiting. Each env may set:

- `max_concurrent`: its episodes in flight (0 = no cap). A rollout waits for its env's slot before it takes a
  request slot, so an env at its cap holds at most that many request slots;
- `timeout_s`: the longest one episode may run, model calls included (0 = none); past it the rollout errors
  (`errors/env`), naming the key;
- `tool_calls_per_s`: the env's tool calls (its `env_response` between turns, the in-process verifiers
  driver's tool calls) paced to this rate over all its rollouts (0 = no pacing), for tools behind a rate-limited
  API. Tool calls made inside verifiers' own loop or env server (a harness program's) are not seen here.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from primejax.utils.sections import Section, option, section


@section
class EnvLimitsConfig(Section):
    """One environment's limits (module docstring of primejax/envs/env_limits.py)."""

    max_concurrent: int = option(0, "episodes of this env in flight; 0 = no cap", ge=0, le=1 << 20)
    timeout_s: float = option(0.0, "longest one episode may run (model calls included); 0 = none", ge=0)
    tool_calls_per_s: float = option(0.0, "tool calls per second over all its rollouts; 0 = no pacing", ge=0)


class Pacer:
    """Spaces calls at least 1/rate apart (no burst): each caller is given the next free time and waits for it."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):  # fmt: skip
        self.interval, self.clock, self.sleep = 1.0 / rate, clock, sleep
        self._next = float("-inf")

    async def wait(self) -> None:
        now = self.clock()
        at = max(self._next, now)
        self._next = at + self.interval
        if at > now:
            await self.sleep(at - now)


#: The limits of the env whose episode this task runs (tool paths deep in an env's driver pace through it).
CURRENT: contextvars.ContextVar[EnvLimits | None] = contextvars.ContextVar(
    "primejax_env_limits", default=None
)


class EnvLimits:
    """One env's limits at run time (shared by its rollouts; bound to the event loop of the first episode)."""

    def __init__(self, config: EnvLimitsConfig | None = None, name: str = ""):
        self.config, self.name = config or EnvLimitsConfig(), name
        c = self.config
        self._slots = asyncio.Semaphore(c.max_concurrent) if c.max_concurrent else None
        self._pacer = Pacer(c.tool_calls_per_s) if c.tool_calls_per_s else None
        self.in_flight = 0

    @contextlib.asynccontextmanager
    async def episode(self) -> AsyncIterator[None]:
        """One episode of this env: its slot (max_concurrent), its deadline (timeout_s), its tool pacing."""
        async with self._slots or contextlib.nullcontext():
            self.in_flight += 1
            token = CURRENT.set(self)
            try:
                if not self.config.timeout_s:
                    yield
                    return
                try:
                    async with asyncio.timeout(self.config.timeout_s):
                        yield
                except TimeoutError:
                    raise TimeoutError(f"the episode ran past {self.config.timeout_s:g} s "
                                       f"(orchestrator.envs.{self.name}.limits.timeout_s)") from None  # fmt: skip
            finally:
                CURRENT.reset(token)
                self.in_flight -= 1

    async def tool_call(self) -> None:
        """Wait for this env's next tool-call turn (tool_calls_per_s)."""
        if self._pacer is not None:
            await self._pacer.wait()


async def pace_tool_call() -> None:
    """Called before an env's tool call: waits for its turn under the running episode's env limits, if any."""
    limits = CURRENT.get()
    if limits is not None:
        await limits.tool_call()
