"""How many inference requests the orchestrator keeps in flight: a limiter whose limit can move, and an AIMD
controller that moves it from the servers' own load signals (docs/rollouts.md#adaptive-concurrency).

`Limiter` is an `async with` gate like a semaphore whose `limit` may change at any time: lowering it never
interrupts a request already running, it only holds back new ones until the count drops below it.

`AIMDController` reads each server's Prometheus `/metrics` (vLLM: `vllm:kv_cache_usage_perc`,
`vllm:num_requests_waiting`, `vllm:num_preemptions_total`) every `interval_s` and applies additive increase /
multiplicative decrease between `floor` and `cap`: pressure on any server (KV usage above `kv_high`, a waiting
queue longer than `waiting_high`, or new preemptions since the last look) multiplies the limit by `decrease`;
otherwise, if the limit was actually reached since the last look (the orchestrator had work waiting), it grows
by `increase`. An unreadable server says nothing (no change). Time is injected so tests run on a fake clock.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# The server metrics the controller reads (vLLM's Prometheus names; counters may carry a _total suffix).
KV_USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
PREEMPTIONS = "vllm:num_preemptions"


def parse_prometheus(
    text: str, names: tuple[str, ...] = (KV_USAGE, WAITING, RUNNING, PREEMPTIONS)
) -> dict[str, float]:
    """Sum of every sample of each metric in `names` (label sets added up; `_total` suffix accepted). Lines that
    do not parse are skipped: a server's metrics page is input, not trusted to be well formed."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, rest = line.partition(" ")
        name = head.split("{", 1)[0]
        if name.endswith("_total"):
            name = name[: -len("_total")]
        if name not in names:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            out[name] = out.get(name, 0.0) + value
    return out


#: The waiting order of a request at the `Limiter` (lower goes first). The continuous pool sets it to the
#: group's dispatch number, so the next turn of an older rollout passes before a newer group's first request:
#: work already under way finishes (and stays within the off-policy bound) before new work starts.
PRIORITY: contextvars.ContextVar[int] = contextvars.ContextVar("primejax_request_priority", default=0)


class Limiter:
    """An async gate with a movable limit; waiters pass in `PRIORITY` order (then arrival order); counts what
    passed and whether anything had to wait."""

    def __init__(self, limit: int):
        self._limit = max(1, int(limit))
        self.in_flight = 0
        self.peak = 0  # highest in_flight since the controller last looked
        self.saturated = False  # a request waited for a slot since the controller last looked
        self._waiters: list[tuple[int, int, asyncio.Future]] = []
        self._arrivals = itertools.count()

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def waiting(self) -> int:
        return sum(not f.done() for _, _, f in self._waiters)

    def _wake(self) -> None:
        while self._waiters and self.in_flight < self._limit:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():  # a cancelled waiter gave up its place
                self.in_flight += 1  # handed over here, so no newcomer can take the slot first
                fut.set_result(None)

    async def set_limit(self, limit: int) -> None:
        self._limit = max(1, int(limit))
        self._wake()

    async def __aenter__(self) -> Limiter:
        if self.in_flight < self._limit and not self._waiters:
            self.in_flight += 1
        else:
            self.saturated = True
            fut = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiters, (PRIORITY.get(), next(self._arrivals), fut))
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # the slot was handed over just as we were cancelled
                    self.in_flight -= 1
                    self._wake()
                raise
        self.peak = max(self.peak, self.in_flight)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.in_flight -= 1
        self._wake()


@dataclass
class AIMDSettings:
    floor: int
    cap: int
    increase: int = 4
    decrease: float = 0.7
    kv_high: float = 0.9
    waiting_high: float = 0.0
    interval_s: float = 1.0


class AIMDController:
    """Moves `limiter.limit` from the servers' load (see module docstring). `read_metrics()` returns one dict of
    parsed metrics per server (None for a server that could not be read)."""

    def __init__(
        self,
        limiter: Limiter,
        settings: AIMDSettings,
        read_metrics: Callable[[], Awaitable[list[dict[str, float] | None]]],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.limiter, self.s, self.read_metrics, self._sleep = limiter, settings, read_metrics, sleep
        self._preemptions: list[float] | None = None
        self.decreases = 0
        self.increases = 0

    def decide(self, servers: list[dict[str, float] | None]) -> int:
        """The next limit from one look at the servers (pure apart from remembering the preemption counters)."""
        s, limit = self.s, self.limiter.limit
        known = [m for m in servers if m is not None]
        if not known:
            return limit
        preempt = [m.get(PREEMPTIONS, 0.0) for m in servers if m is not None]
        new_preemptions = (
            self._preemptions is not None
            and len(self._preemptions) == len(preempt)
            and any(a > b for a, b in zip(preempt, self._preemptions, strict=True))
        )
        self._preemptions = preempt
        pressure = new_preemptions or any(
            m.get(KV_USAGE, 0.0) > s.kv_high or m.get(WAITING, 0.0) > s.waiting_high for m in known
        )
        if pressure:
            self.decreases += 1
            return max(s.floor, int(limit * s.decrease))
        if self.limiter.saturated or self.limiter.peak >= limit:
            self.increases += 1
            return min(s.cap, limit + s.increase)
        return limit

    async def tick(self) -> int:
        servers = await self.read_metrics()
        limit = self.decide(servers)
        self.limiter.saturated, self.limiter.peak = False, self.limiter.in_flight
        if limit != self.limiter.limit:
            await self.limiter.set_limit(limit)
        return limit

    async def run(self) -> None:
        """Forever (cancel the task to stop)."""
        while True:
            try:
                await self.tick()
            except Exception as e:  # noqa: BLE001 - a metrics hiccup must not stop the run; the limit stays
                log.warning("concurrency controller: %s", e)
            await self._sleep(self.s.interval_s)
