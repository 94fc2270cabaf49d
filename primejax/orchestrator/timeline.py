"""Where a step's wall clock went: a trace of every model request, environment call, wait and weight update.

The generator records a span when a piece of work ends (`Timeline.add`): its category, name, start and end
on one clock, and its track, a (lane, name) pair:

    ("step", "orchestrator")       the step's phases: wait_for_weights, generate (or batch_cut), postprocess, gc
    ("weights", "orchestrator")    each weight update the orchestrator made (its version, how it travelled)
    ("weights", "server <i>")      each server's own load time of that update (ends when the update ended)
    ("groups", "group <g>")        a group's shared first request (n = group_size)
    ("groups", "group <g> · <m>")  one rollout's later requests, env calls (env_response, score, tools), the
                                    env's own code between the model calls it makes (`env`, `tool` after a
                                    tool call) and its waits for a request slot (`wait`)

Each step the orchestrator takes the spans that ended since the previous step and writes them as a
Chrome/Perfetto trace (`<run>/timeline/step_N.json`: open it in https://ui.perfetto.dev or chrome://tracing;
`python -m tools.plot RUN --timeline N` draws it as a PNG; every `monitor.timeline_image_every` steps the
orchestrator logs that drawing to TensorBoard and W&B, primejax.orchestrator.timeline_plot). Spans are kept up
to `max_spans` per step (a step with more drops the rest and says how many in the trace's `otherData`).
"""

from __future__ import annotations

import contextvars
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

Track = tuple[str, str]
LANES = ("step", "weights", "groups")  # the trace's processes, top to bottom
#: The track the running task's work belongs to (set per group and per rollout task by the generator).
TRACK: contextvars.ContextVar[Track | None] = contextvars.ContextVar("primejax_timeline_track", default=None)


@dataclass
class Span:
    cat: str  # phase | request | wait | env | tool | weights
    name: str
    start: float
    end: float
    track: Track
    args: dict[str, Any] = field(default_factory=dict)


class Timeline:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_spans: int = 200_000):
        self.clock = clock
        self.max_spans = max_spans
        self.origin = clock()  # trace time 0
        self.wall_origin = time.time()
        self._spans: list[Span] = []
        self.dropped = 0

    def add(
        self, cat: str, name: str, start: float, end: float, track: Track | None = None, **args: Any
    ) -> None:
        """Record finished work; `track` defaults to the running task's (TRACK), else the step's track."""
        if len(self._spans) >= self.max_spans:
            self.dropped += 1
            return
        self._spans.append(
            Span(cat, name, start, end, track or TRACK.get() or ("step", "orchestrator"), args)
        )

    @contextmanager
    def span(self, cat: str, name: str, track: Track | None = None, **args: Any) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.add(cat, name, start, self.clock(), track, **args)

    def take(self) -> tuple[list[Span], int]:
        """The spans recorded since the previous call, and how many were dropped meanwhile."""
        spans, self._spans = self._spans, []
        dropped, self.dropped = self.dropped, 0
        return spans, dropped


def _natural(text: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def chrome_trace(
    spans: list[Span], origin: float, *, step: int, wall_origin: float = 0.0, dropped: int = 0
) -> dict[str, Any]:
    """The spans as a Chrome trace-event JSON object ("X" complete events, microseconds since `origin`; one
    process per lane, one thread per track, named by metadata events)."""
    tracks = sorted(
        {s.track for s in spans},
        key=lambda t: (LANES.index(t[0]) if t[0] in LANES else len(LANES), t[0], _natural(t[1])),
    )
    pids = {lane: i + 1 for i, lane in enumerate(dict.fromkeys(t[0] for t in tracks))}
    tids = {t: i + 1 for i, t in enumerate(tracks)}
    events: list[dict[str, Any]] = []
    for lane, pid in pids.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": lane}})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
    for track, tid in tids.items():
        pid = pids[track[0]]
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track[1]}})
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )
    for s in sorted(spans, key=lambda s: s.start):
        events.append(
            {
                "name": s.name,
                "cat": s.cat,
                "ph": "X",
                "pid": pids[s.track[0]],
                "tid": tids[s.track],
                "ts": round((s.start - origin) * 1e6, 1),
                "dur": round(max(0.0, s.end - s.start) * 1e6, 1),
                "args": s.args,
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"step": step, "wall_clock_origin": wall_origin, "dropped_spans": dropped},
    }
