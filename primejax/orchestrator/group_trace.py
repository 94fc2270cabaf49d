"""The policy versions and lost requests of one running group, for the continuous pool (docs/rollouts.md).

The pool sets a fresh `GroupTrace` in `TRACE` in each group's task; the generator notes the policy version at
the start of every request the group makes (`note_version`), and the outage counter counts the requests the
server lost. Its own module so that the pool and the outage loop read it without importing the generator.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field


@dataclass
class GroupTrace:
    """What a continuous pool needs to know about one group while it runs (set per group task in TRACE):
    the policy version read at the start of each of its requests (the oldest bounds every sample it can
    yield) and how many of its requests the server lost (the group is then dispatched again)."""

    versions: list[int] = field(default_factory=list)
    lost: int = 0

    @property
    def oldest(self) -> int | None:
        return min(self.versions, default=None)


#: The running group's trace; a task inherits it from the group task that spawned it (asyncio copies contexts).
TRACE: contextvars.ContextVar[GroupTrace | None] = contextvars.ContextVar(
    "primejax_group_trace", default=None
)


def note_version(version: int) -> None:
    """Adds a request's policy version to the running group's trace; a no-op outside a continuous pool."""
    trace = TRACE.get()
    if trace is not None:
        trace.versions.append(version)
