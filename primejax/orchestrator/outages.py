"""Inference outages: counting the requests a server lost, and the one loop that redoes a step's generation.

A request the server rejected (4xx) is the rollout's problem and fails it alone; a lost one (unreachable, 5xx,
after the client's own retries) says nothing about the rollout. After a lost request, or when the server no
longer serves the tracked weights (it restarted on the base model), the step's generation is suspect: it is
redone once the server answers and has been set back to the tracked weights, so no step is lost or skewed.
Each dispatch mode (dispatch.py) says how one attempt runs and what to throw away before the next.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from primejax.inference.server_pool import InferenceError
from primejax.orchestrator.group_trace import TRACE

log = logging.getLogger(__name__)
MAX_STEP_ATTEMPTS = 4  # generation attempts of one step across inference outages before the run gives up
T = TypeVar("T")


class OutageCounter:
    """Wraps the sampling client and counts requests lost to the server (unreachable, 5xx, after retries)."""

    def __init__(self, client: Any):
        self._client = client
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._client.generate(*args, **kwargs)
        except InferenceError as e:
            if e.status is None or e.status >= 500:
                self.count += 1
                if (trace := TRACE.get()) is not None:  # a continuous pool dispatches this group again
                    trace.lost += 1
            raise


class StepRetry:
    """Runs one step's generation until an attempt comes back clean, at most MAX_STEP_ATTEMPTS times.

    `attempt()` returns (value, None) when clean or (None, reason) when suspect; an InferenceError it raises is
    an outage too. Between attempts: `discard()` (what the mode throws away), the server's recovery
    (`client.wait_ready`), and the tracked weights set back on it (`tracker.resync`), inside the next attempt
    so that a failure there counts as one. `resync_first`: also resync before the first attempt.
    """

    def __init__(self, client: Any, tracker: Any, recovery_timeout_s: float):
        self.client = client
        self.tracker = tracker
        self.recovery_timeout_s = recovery_timeout_s

    async def run(
        self,
        step: int,
        attempt: Callable[[], Awaitable[tuple[T | None, str | None]]],
        discard: Callable[[], None],
        *,
        redo: str,
        resync_first: bool,
    ) -> T:
        for n in range(1, MAX_STEP_ATTEMPTS + 1):
            try:
                if n > 1 or resync_first:
                    await self.tracker.resync()
                value, reason = await attempt()
                if reason is None:
                    return value  # type: ignore[return-value]
            except InferenceError as e:
                reason = str(e)
            if n == MAX_STEP_ATTEMPTS:
                raise RuntimeError(f"step {step}: inference failed in {n} attempts in a row ({reason})")
            log.warning("step %d: inference outage (%s); %s", step, reason, redo)
            discard()
            await self.client.wait_ready(self.recovery_timeout_s)
        raise AssertionError("unreachable")
