"""Event-loop lag: how late a timer that should fire every `interval_s` actually fires.

Everything the orchestrator does shares one asyncio loop; a stage that blocks it (a CPU-heavy reward, a big
JSON parse) delays every request and every timer. The lag of this probe is that delay, reported per step as
`loop_lag/{p50,p99,max}` (seconds).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class LoopLag:
    def __init__(self, interval_s: float = 0.05, clock: Callable[[], float] = time.perf_counter):
        self.interval_s, self.clock = interval_s, clock
        self.samples: list[float] = []

    async def run(self) -> None:
        """Forever (cancel the task to stop)."""
        while True:
            start = self.clock()
            await asyncio.sleep(self.interval_s)
            self.samples.append(max(0.0, self.clock() - start - self.interval_s))

    def take(self) -> dict[str, float]:
        """Lag statistics since the last call (then forgotten)."""
        samples, self.samples = self.samples, []
        if not samples:
            return {}
        return {
            "loop_lag/p50": percentile(samples, 0.5),
            "loop_lag/p99": percentile(samples, 0.99),
            "loop_lag/max": max(samples),
        }
