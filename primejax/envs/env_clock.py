"""How long an environment's own code may hold a rollout that it drives: `orchestrator.env_timeout_s`.

An env that runs its own episode (`drives_rollout`: a verifiers Env's `setup` / `run`, the game or user it plays
between agent turns, a task's scoring when an interaction closes, toolset setup, stop hooks) alternates between
its own code and the calls it makes back into the orchestrator: model calls (bounded by the inference client)
and tool calls (bounded by `tool_timeout_s`, primejax/envs/tool_limits.py). The orchestrator cannot wrap the
episode whole in `env_timeout_s` (a long game with a slow server is not a hang), so an `EnvClock` runs only while
no model or tool call is in flight, restarting at each one's end: one stretch of the env's own code longer than
the limit (an env step whose answer never comes) cancels the episode and errors that rollout alone.

An env that hangs again while unwinding (a `finally` that awaits forever) is cancelled again after each further
`timeout_s`, so the rollout always ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Iterator
from typing import TypeVar

T = TypeVar("T")

#: The clock of the rollout whose env code is running (tool calls pause it from inside the env's driver).
_CURRENT: contextvars.ContextVar[EnvClock | None] = contextvars.ContextVar("primejax_env_clock", default=None)


class EnvTimeout(TimeoutError):
    """An environment's own code held its rollout past `orchestrator.env_timeout_s` (errors the rollout)."""


class EnvClock:
    """One rollout's budget for env code between the calls it makes back (module docstring)."""

    def __init__(self, timeout_s: float, what: str):
        self.timeout_s, self.what = timeout_s, what
        self.expired = False
        self._running = False  # between `run`'s start and end: a call ending later (a task the env leaked) re-arms nothing
        self._held = 0  # model / tool calls in flight (an episode's seats may call concurrently)
        self._cancels = 0
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def run(self, call: Awaitable[T]) -> T:
        """Await the env's episode `call` under the clock; raises `EnvTimeout` when the env held it too long."""
        self._task, self._loop = asyncio.current_task(), asyncio.get_running_loop()
        baseline = self._task.cancelling()
        token = _CURRENT.set(self)
        self._running = True
        self._arm()
        try:
            result = await call
        except BaseException:
            if self._settle() <= baseline and self.expired:
                raise self._error() from None
            raise
        finally:
            self._running = False
            self._stop()
            _CURRENT.reset(token)
        if self._settle() <= baseline and self.expired:  # the env swallowed the cancellation and returned
            raise self._error()
        return result

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A model or tool call: the env's clock stops for its duration and restarts in full after it."""
        self._held += 1
        if self._held == 1 and not self.expired:
            self._stop()
        try:
            yield
        finally:
            self._held -= 1
            if self._held == 0 and self._running and not self.expired:
                self._arm()

    def _error(self) -> EnvTimeout:
        return EnvTimeout(
            f"environment {self.what} held the rollout {self.timeout_s:g} s without a model or tool call "
            "(orchestrator.env_timeout_s)"
        )

    def _arm(self) -> None:
        self._stop()
        self._timer = self._loop.call_later(self.timeout_s, self._expire)

    def _stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        if not self._running:
            return
        self.expired = True
        self._cancels += 1
        self._task.cancel()
        self._timer = self._loop.call_later(
            self.timeout_s, self._expire
        )  # again, if it hangs while unwinding

    def _settle(self) -> int:
        """Take back the cancellations this clock made; the task's remaining (someone else's) count."""
        while self._cancels:
            self._cancels -= 1
            self._task.uncancel()
        return self._task.cancelling()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Pause the calling rollout's env clock, if it has one, for a call back out of the env (a tool call)."""
    clock = _CURRENT.get()
    if clock is None:
        yield
        return
    with clock.paused():
        yield
