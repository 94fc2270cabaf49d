"""The inference servers' own metrics, per step: what each vLLM replica says about its throughput and load.

`ServerStats` reads every server's Prometheus `/metrics` page (through the client's reader, the one the AIMD
controller uses) every `poll_s` seconds while a step runs and once at its end, and `take()` turns the readings
since the previous step into that step's metrics:

    server/<i>/gen_tokens_per_s     generated tokens / s  (counter vllm:generation_tokens, over the step's wall time)
    server/<i>/prompt_tokens_per_s  prefilled prompt tokens / s  (vllm:prompt_tokens)
    server/<i>/kv_cache_usage       mean over the step's readings of vllm:kv_cache_usage_perc (0..1); _max: highest
    server/<i>/running, waiting     mean requests running / waiting (vllm:num_requests_running / _waiting)
    server/<i>/preemptions          requests preempted during the step (counter vllm:num_preemptions)
    server/<i>/weight_update_s      seconds the server spent loading new weights during the step (its own figure)
    server/total/*                  the same summed over replicas (kv_cache_usage: server/max/kv_cache_usage)

`i` is the server's index in `orchestrator.client.base_urls` (as `server/<i>/busy`). A server that could not be
read at the start or end of a step reports no rates for it; a counter that went down (the server restarted)
counts from zero. Time is injected so tests run on a fake clock. docs/monitoring.md shows where they land.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Awaitable, Callable

from primejax.orchestrator.concurrency import KV_USAGE, PREEMPTIONS, RUNNING, WAITING, parse_prometheus

log = logging.getLogger(__name__)

GEN_TOKENS = "vllm:generation_tokens"
PROMPT_TOKENS = "vllm:prompt_tokens"
NAMES = (KV_USAGE, WAITING, RUNNING, PREEMPTIONS, GEN_TOKENS, PROMPT_TOKENS)
GAUGES = {KV_USAGE: "kv_cache_usage", RUNNING: "running", WAITING: "waiting"}
RATES = {GEN_TOKENS: "gen_tokens_per_s", PROMPT_TOKENS: "prompt_tokens_per_s"}
MAX_READINGS = 10_000  # readings kept per step (a step of days at poll_s 2 s stays bounded)

Reading = tuple[float, list[dict[str, float] | None]]  # (clock time, per server parsed metrics or None)


def parse_pages(pages: list[bytes | str | None]) -> list[dict[str, float] | None]:
    """Each server's page (as the client read it: bytes, or text) parsed for NAMES; None stays None. Bytes are
    decoded leniently (a page is input, not trusted to be UTF-8). Run off the event loop: a page may be megabytes."""
    out: list[dict[str, float] | None] = []
    for page in pages:
        if isinstance(page, bytes):
            page = page.decode("utf-8", errors="replace")
        out.append(None if page is None else parse_prometheus(page, NAMES))
    return out


def _increase(before: float, after: float) -> float:
    """A counter's increase between two readings; a counter that went down restarted from zero."""
    return after - before if after >= before else after


def step_metrics(
    start: Reading | None,
    readings: list[Reading],
    loads: dict[int, float] | None = None,
) -> dict[str, float]:
    """The metrics of one step from the reading that closed the previous step (`start`, None for the first)
    and the step's own readings (the last closes it); `loads`: weight-load seconds per server index."""
    out: dict[str, float] = {}
    end_t, end = readings[-1] if readings else (0.0, [])
    n = max(len(end), len(start[1]) if start else 0)
    totals: dict[str, float] = {}
    for i in range(n):
        samples = [r[i] for _, r in readings if i < len(r) and r[i] is not None]
        for name, short in GAUGES.items():
            values = [s[name] for s in samples if name in s]
            if values:
                out[f"server/{i}/{short}"] = statistics.fmean(values)
                if name == KV_USAGE:
                    out[f"server/{i}/{short}_max"] = max(values)
                else:
                    totals[short] = totals.get(short, 0.0) + out[f"server/{i}/{short}"]
        first = start[1][i] if start is not None and i < len(start[1]) else None
        last = end[i] if i < len(end) else None
        if first is not None and last is not None and end_t > start[0]:
            span = end_t - start[0]
            for name, short in RATES.items():
                if name in first and name in last:
                    out[f"server/{i}/{short}"] = _increase(first[name], last[name]) / span
                    totals[short] = totals.get(short, 0.0) + out[f"server/{i}/{short}"]
            if PREEMPTIONS in first and PREEMPTIONS in last:
                out[f"server/{i}/preemptions"] = _increase(first[PREEMPTIONS], last[PREEMPTIONS])
                totals["preemptions"] = totals.get("preemptions", 0.0) + out[f"server/{i}/preemptions"]
    for i, seconds in sorted((loads or {}).items()):
        out[f"server/{i}/weight_update_s"] = seconds
        totals["weight_update_s"] = totals.get("weight_update_s", 0.0) + seconds
    out.update({f"server/total/{k}": v for k, v in totals.items()})
    kv = [v for k, v in out.items() if k.endswith("/kv_cache_usage_max")]
    if kv:
        out["server/max/kv_cache_usage"] = max(kv)
    return out


class ServerStats:
    """Reads the servers' metrics in the background (`run()`) and per step (`take()`)."""

    def __init__(
        self,
        read_texts: Callable[[], Awaitable[list[bytes | str | None]]],
        *,
        poll_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self._read, self.poll_s, self._clock, self._sleep = read_texts, poll_s, clock, sleep
        self._start: Reading | None = None  # the reading that closed the previous step
        self._readings: list[Reading] = []
        self._loads: dict[int, float] = {}

    async def read(self) -> Reading:
        texts = await self._read()
        reading = (self._clock(), await asyncio.to_thread(parse_pages, texts))
        if len(self._readings) < MAX_READINGS:
            self._readings.append(reading)
        return reading

    def weight_loads(self, seconds: dict[int, float]) -> None:
        """Record one weight update's load time per server index (added up over the step)."""
        for i, s in seconds.items():
            self._loads[i] = self._loads.get(i, 0.0) + float(s)

    async def take(self) -> dict[str, float]:
        """This step's metrics (see the module doc); a failed read gives the step no server rates."""
        try:
            closing = await self.read()
        except Exception as e:  # noqa: BLE001 - a metrics hiccup must not stop the run
            log.warning("reading the servers' metrics failed: %s", e)
            closing = None
        readings, self._readings = self._readings, []
        loads, self._loads = self._loads, {}
        if closing is None:
            return step_metrics(None, [], loads)
        # The first step starts at the first reading (the orchestrator takes one before its first step).
        start = self._start or (readings[0] if len(readings) > 1 else None)
        self._start = closing
        return step_metrics(start, readings, loads)

    async def run(self) -> None:
        """Read every `poll_s` seconds, forever (cancel the task to stop); poll_s 0 reads only in `take()`."""
        if self.poll_s <= 0:
            return
        while True:
            await self._sleep(self.poll_s)
            try:
                await self.read()
            except Exception as e:  # noqa: BLE001 - a metrics hiccup must not stop the run
                log.warning("reading the servers' metrics failed: %s", e)
