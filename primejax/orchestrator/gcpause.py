"""Keep Python's cyclic garbage collector from stalling the orchestrator's event loop.

With thousands of rollouts in flight the process holds hundreds of thousands of tracked objects (start-up
imports, every in-flight rollout's token lists, closures and tasks). A full (generation 2) collection walks all
of them while the loop waits: in the fleet simulator's `--lag` run (tools/bench_fleet.py at commit adbf550;
10,000 rollouts in flight) single collections took 0.6-2.5 s and almost never found garbage, because the
rollouts' data is freed by reference counting when a group is dropped. This is the event-loop lag's largest source (docs/benchmarks_log.md, "Event-loop lag").

The policy (`orchestrator.gc`):
- automatic full collections are off (the young generations are collected as usual);
- at start-up `gc.freeze()` moves what exists (modules, tokenizer, envs) to the permanent
  generation: no later collection walks it;
- after every step's cut, `gc.freeze()` again: what survived the step (in-flight rollouts, buffers) leaves the
  collected generations. Objects freed by reference counting are freed as usual whether frozen or not; only
  garbage in reference cycles among frozen objects waits;
- every `full_every` steps, one full collection over everything (`gc.unfreeze()`, `gc.collect()`, freeze
  again) frees those cycles; its duration is the step's `gc/full_s`. At the end of the run everything is
  unfrozen and collected once, so an orchestrator run inside a longer-lived process leaves the collector as it
found it.

Metrics per step: `gc/collections`, `gc/pause_max_s` (the longest automatic collection since the last step),
`gc/frozen` (objects in the permanent generation), `gc/full_s` on the steps with a full collection.
"""

from __future__ import annotations

import gc
import time
from typing import Any

NEVER = 2**30  # a generation-2 threshold no count reaches


class GcPolicy:
    def __init__(self, freeze: bool = True, full_every: int = 50) -> None:
        self.freeze, self.full_every = freeze, full_every
        self._pauses: list[float] = []
        self._started_at = 0.0
        self._active = False
        self._thresholds = gc.get_threshold()

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
        else:
            self._pauses.append(time.perf_counter() - self._started_at)

    def start(self) -> None:
        """At the start of a run: the collector's pauses are measured, start-up objects frozen (if enabled)."""
        if self._active:
            return
        self._active = True
        gc.callbacks.append(self._callback)
        if self.freeze:
            self._thresholds = gc.get_threshold()
            # No automatic full collections: the young generations are still collected as usual; what survives
            # them waits for the step's freeze, and cycles for the periodic full collection.
            gc.set_threshold(self._thresholds[0], self._thresholds[1], NEVER)
            gc.freeze()  # no collection first: in a test process full of JAX it would cost a second per run

    def after_step(self, step: int) -> dict[str, float]:
        """After a step's batch was cut: freeze its survivors; a full collection every `full_every` steps."""
        metrics: dict[str, float] = {}
        pauses, self._pauses = self._pauses, []
        if self.freeze:
            if self.full_every and step % self.full_every == 0:
                t0 = time.perf_counter()
                gc.unfreeze()
                gc.collect()
                metrics["gc/full_s"] = time.perf_counter() - t0
                self._pauses = []  # that collection is reported as gc/full_s, not as a pause
            gc.freeze()
            metrics["gc/frozen"] = float(gc.get_freeze_count())
        metrics["gc/collections"] = float(len(pauses))
        metrics["gc/pause_max_s"] = max(pauses, default=0.0)
        return metrics

    def stop(self) -> None:
        """At the end of a run: nothing stays frozen, the callback is removed."""
        if not self._active:
            return
        self._active = False
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if self.freeze:
            gc.set_threshold(*self._thresholds)
            gc.unfreeze()
            gc.collect()  # cycles frozen during the run (start-up's included) are freed now, not at exit
