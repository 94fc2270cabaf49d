"""How busy each inference server was, as the orchestrator sees it: the share of wall time with at least one
of its requests outstanding there, per server, since the previous reading (the fleet simulator's definition,
tools/bench_fleet.py at commit adbf550). A server idles at a step barrier while the slowest rollouts finish elsewhere; this is
the figure that shows it (`server/<i>/busy` per step, docs/rollouts.md)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


class BusyMeter:
    """Also the client's count of requests outstanding per server (`outstanding`), which its least-loaded
    placement reads."""

    def __init__(self, urls: Sequence[str], clock: Callable[[], float] = time.monotonic):
        self.urls = list(urls)
        self._clock = clock
        self.outstanding = dict.fromkeys(self.urls, 0)
        self._busy_since: dict[str, float] = {}
        self._busy_s = dict.fromkeys(self.urls, 0.0)
        self._since = clock()

    def started(self, url: str) -> None:
        if self.outstanding[url] == 0:
            self._busy_since[url] = self._clock()
        self.outstanding[url] += 1

    def finished(self, url: str) -> None:
        self.outstanding[url] -= 1
        if self.outstanding[url] == 0:
            self._busy_s[url] += self._clock() - self._busy_since.pop(url)

    def take(self) -> dict[str, float]:
        """`server/<i>/busy` (i: the server's index in the client's URL list) and `server/busy_mean` since the
        previous call; a request still outstanding counts up to now and goes on counting from now."""
        now = self._clock()
        span = now - self._since
        out: dict[str, float] = {}
        for i, url in enumerate(self.urls):
            busy = self._busy_s[url]
            if url in self._busy_since:
                busy += now - self._busy_since[url]
                self._busy_since[url] = now
            self._busy_s[url] = 0.0
            out[f"server/{i}/busy"] = min(1.0, busy / span) if span > 0 else 0.0
        self._since = now
        if out:
            out["server/busy_mean"] = sum(out.values()) / len(out)
        return out
