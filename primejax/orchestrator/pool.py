"""The continuous rollout pool (`orchestrator.pool.mode = "continuous"`, docs/rollouts.md).

Groups are dispatched as soon as there is room, not per step: a dispatcher task keeps up to `capacity` groups
in flight or finished-and-waiting, and each step's batch is cut from finished groups (first finished, first
cut) as soon as they hold `batch_size` trainable rollouts (or `batch_tokens` of their training tokens,
primejax/orchestrator/token_budget.py); what is left waits for the next cut.

The off-policy bound holds per sample. Every request of a group notes the policy version it started under
(`group_trace.GroupTrace`); a group's samples are no older than its oldest request. Step n may train on samples
of θ_{n-1-k} or newer (`policy.min_policy_version`, k = async_level), and the step being cut only grows, so a
group whose oldest request is below the current step's bound can never be used: if it is still running its
task is cancelled (the HTTP request is closed, which makes vLLM abort it) and counted `cancelled_stale`; if it
already finished it is dropped (`dropped_stale`).

The pool refills whenever there is room, so a few slow groups never hold up a cut: the cut takes whatever
finished first and the stragglers are carried (or cancelled once stale). It does not dispatch while the served
version v is below the bound of the step to be cut next (waiting for the trainer); otherwise it dispatches the
groups that the steps a group started now could serve (those up to v + 1 + k) still lack, counting finished
groups' trainable rollouts and running groups at full size, at most up to `capacity` groups held. `capacity`
bounds the work at risk: with the trainer as the bottleneck, up to that many groups may turn stale and be
cancelled.

An env with `orchestrator.envs.<name>.limits.max_concurrent` = m (primejax/envs/env_limits.py) has at most
ceil(m / group_size) groups running: while it is at that cap the pool draws its prompts from the other envs only
(and holds back its requeued ones). Without it a slow env's groups, waiting for its episode slots, would fill
`capacity` and leave the other envs nothing to run. When every env is at its cap the pool waits for a group
to finish.

A group that lost a request to the server (outage, dead replica) is dispatched again with the same prompt
(`redispatched`). The prompts of unfinished groups are part of the orchestrator checkpoint: on resume they are
dispatched first (in-flight work is redone, not lost).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from primejax.orchestrator.concurrency import PRIORITY
from primejax.orchestrator.group_trace import TRACE, GroupTrace
from primejax.orchestrator.policy import min_policy_version
from primejax.orchestrator.rollout import Rollout
from primejax.orchestrator.token_budget import TokenMeter

log = logging.getLogger(__name__)

RunGroup = Callable[[str, int, int, int], Awaitable[list[Rollout]]]  # (env, index, group_id, step) -> group


@dataclass
class Ticket:
    """One dispatched group."""

    id: int
    env: str
    index: int
    step: int  # the step being cut when it was dispatched (seeds and fault points)
    dispatched_at: float
    trace: GroupTrace = field(default_factory=GroupTrace)
    task: asyncio.Task | None = None
    rollouts: list[Rollout] | None = None
    finished_at: float = 0.0

    @property
    def oldest(self) -> int | None:
        return self.trace.oldest

    #: Trainable rollouts, counted once when the group finished (its filters ran before): the pool's wait
    #: conditions sum it over every finished group at each group's end, which at 10,000 rollouts in flight made
    #: a per-rollout count the loop's largest own cost (docs/rollouts.md).
    trainable: int = 0
    tokens: int = 0  # their training tokens, with orchestrator.batch_tokens (counted once too)

    def finish(self, rollouts: list[Rollout] | None) -> None:
        self.rollouts = rollouts
        self.trainable = sum(r.ok and not r.dropped for r in rollouts or [])


@dataclass
class Cut:
    """A step's share of the pool: the groups cut (in finish order) and the wait it took."""

    groups: list[list[Rollout]]
    wait_s: float
    counts: dict[str, float]


class RolloutPool:
    def __init__(
        self,
        run_group: RunGroup,
        sample: Callable[[int], list[tuple[str, int]]],
        policy: Any,
        *,
        batch_size: int,
        group_size: int,
        async_level: int,
        capacity: int,
        oversampling: float = 1.0,
        group_timeout_s: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        batch_tokens: int = 0,
        seq_len: int = 1 << 30,
        env_caps: dict[str, int] | None = None,
    ):
        """`run_group(env, index, group_id, step)` generates and finalizes one group; `sample(n)` draws n
        (env, index) prompts; `policy` has `.version` and `wait_for(v)` (the PolicyTracker); a group running
        longer than `group_timeout_s` (> 0) is cancelled and counted `timed_out` (its rollouts never train).
        `env_caps`: every env's episodes in flight at most (its limits.max_concurrent; 0: no cap); with any cap,
        `sample(n, skip=names)` must draw from the envs not in `skip` (Buffer.sample)."""
        self.run_group, self.sample, self.policy = run_group, sample, policy
        self.group_timeout_s = group_timeout_s
        self.batch_size, self.group_size, self.k = batch_size, group_size, async_level
        self.capacity, self.oversampling, self.clock = max(1, capacity), oversampling, clock
        # orchestrator.batch_tokens: cuts hold a token budget; dispatch sizes a batch at the rollouts one held
        # (counted as the samples of `seq_len` hold them)
        self.batch_tokens, self.meter = batch_tokens, TokenMeter(seq_len)
        self.env_names = set(env_caps or ())  # every env of the run, when any is capped
        self.group_caps = {
            env: math.ceil(m / group_size) for env, m in (env_caps or {}).items() if m > 0
        }  # groups running at most, per capped env
        self.running: dict[int, Ticket] = {}
        self.done: deque[Ticket] = deque()
        self.requeued: deque[tuple[str, int]] = deque()  # prompts dispatched first (resume, lost requests)
        self.cut_step = 1
        self.counts: Counter = Counter()  # since the last cut
        self.total: Counter = Counter()
        self._next_id = 0
        self._cond: asyncio.Condition | None = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------------------------------ state

    @property
    def bound(self) -> int:
        """The oldest policy version the step being cut may train on."""
        return min_policy_version(self.cut_step, self.k)

    def pending_prompts(self) -> list[tuple[str, int]]:
        """Prompts of every group not yet cut (requeued, finished, running), for the checkpoint."""
        tickets = sorted([*self.done, *self.running.values()], key=lambda t: t.id)
        return [*self.requeued, *((t.env, t.index) for t in tickets)]

    def requeue(self, prompts: list[tuple[str, int]]) -> None:
        self.requeued.extend((str(env), int(index)) for env, index in prompts)

    def _full(self) -> set[str]:
        """The capped envs with as many groups running as their cap allows."""
        if not self.group_caps:
            return set()
        running = Counter(t.env for t in self.running.values())
        return {env for env, cap in self.group_caps.items() if running[env] >= cap}

    def _blocked(self) -> bool:
        """Every env is at its cap: nothing can be dispatched until a group finishes."""
        return bool(self.group_caps) and self._full() == self.env_names

    def _need(self) -> int:
        """Groups worth dispatching now (see module docstring)."""
        v = self.policy.version
        if v < self.bound or self._blocked():
            return 0
        useful_steps = v + 1 + self.k - self.cut_step + 1
        # Running groups count at their full size: with the trainer the bottleneck (v at the bound) a group
        # started now can serve one more step at most, and dispatching past that only feeds the bound's
        # cancellations. A running group that yields fewer trainable rollouts frees its share when it finishes.
        covered = sum(t.trainable for t in self.done) + len(self.running) * self.group_size
        per_batch = (
            self.meter.rollouts_for(self.batch_tokens, self.batch_size)
            if self.batch_tokens
            else self.batch_size
        )
        missing = useful_steps * per_batch - covered
        if missing <= 0:
            return 0  # finished and running work already covers every step a group started now could serve
        # A finished group without a trainable rollout (all errored: a hung env worker, a failing env) holds no
        # batch room; it is cut with the next batch. Up to `capacity` of them are free, so a few errors cannot
        # fill the pool and stall it, while an env that fails every rollout still stops dispatching (the cut then
        # goes on with what it has, see `cut`).
        empty = self._empty()
        held = len(self.running) + len(self.done) - empty + max(0, empty - self.capacity)
        # A refill is capped at the groups the uncovered steps need (scaled by the oversampling factor, as the
        # step mode's draw): a burst up to `capacity` at the bound would start groups no step can use.
        wanted = math.ceil(missing * self.oversampling / self.group_size)
        return max(0, min(self.capacity - held, wanted))

    def _target(self) -> int:
        """What a cut waits for: trainable rollouts (batch_size) or their tokens (batch_tokens)."""
        return self.batch_tokens or self.batch_size

    def _held(self, tickets: Any) -> int:
        return sum(t.tokens for t in tickets) if self.batch_tokens else sum(t.trainable for t in tickets)

    def _empty(self) -> int:
        return sum(t.trainable == 0 for t in self.done)

    # ------------------------------------------------------------------------------------------ tasks

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _notify(self) -> None:
        cond = self._condition()
        async with cond:
            cond.notify_all()

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._dispatcher()), asyncio.create_task(self._versions())]

    async def stop(self) -> None:
        """Cancel the dispatcher and every running group (their requests are aborted)."""
        tasks = [*self._tasks, *(t.task for t in self.running.values() if t.task is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []

    async def _dispatcher(self) -> None:
        cond = self._condition()
        while True:
            async with cond:
                await cond.wait_for(lambda: self._need() > 0)
                n = self._need()
            if self.group_caps:
                self._dispatch_capped(n)
            else:
                fresh = max(0, n - len(self.requeued))
                prompts = [self.requeued.popleft() for _ in range(min(n, len(self.requeued)))] + self.sample(
                    fresh
                )
                for env, index in prompts:
                    self._dispatch(env, index)
            await asyncio.sleep(0)  # let the new groups start before looking again

    def _dispatch_capped(self, n: int) -> None:
        """Up to n groups, none of an env at its cap: requeued prompts first (those of a full env stay queued),
        then fresh ones drawn one at a time from the envs with room."""
        held_back: deque[tuple[str, int]] = deque()
        while n > 0 and self.requeued:
            env, index = self.requeued.popleft()
            if env in self._full():
                held_back.append((env, index))
            else:
                self._dispatch(env, index)
                n -= 1
        self.requeued.extendleft(reversed(held_back))  # in their order, ahead of the rest
        while n > 0 and not self._blocked():
            (pick,) = self.sample(1, skip=self._full())
            self._dispatch(*pick)
            n -= 1

    async def _versions(self) -> None:
        """On every policy update: enforce the bound (it may have moved with the cut) and wake the dispatcher."""
        while True:
            await self.policy.wait_for(self.policy.version + 1)
            self.enforce_bound()
            await self._notify()

    def _dispatch(self, env: str, index: int) -> None:
        ticket = Ticket(
            id=self._next_id, env=env, index=index, step=self.cut_step, dispatched_at=self.clock()
        )
        self._next_id += 1
        self.running[ticket.id] = ticket
        ticket.task = asyncio.create_task(self._run(ticket))
        self.counts["dispatched"] += 1

    async def _run(self, ticket: Ticket) -> None:
        TRACE.set(ticket.trace)  # this task's own context: every request of the group notes its version here
        PRIORITY.set(ticket.id)  # older groups' turns pass the request limit first
        try:
            group = self.run_group(ticket.env, ticket.index, ticket.id, ticket.step)
            if self.group_timeout_s > 0:
                group = asyncio.wait_for(group, self.group_timeout_s)
            ticket.finish(await group)
            if self.batch_tokens:
                ticket.tokens = self.meter.observe(ticket.rollouts or [])
        except TimeoutError:
            log.warning(
                "group %d (%s #%d) timed out after %.0f s: cancelled",
                ticket.id,
                ticket.env,
                ticket.index,
                self.group_timeout_s,
            )
            self.counts["timed_out"] += 1
            ticket.rollouts = None
        except asyncio.CancelledError:
            return  # cancelled by the bound or stop(): the canceller accounted for it
        except Exception as e:  # noqa: BLE001 - one failed group must not stop the pool
            log.warning("group %d (%s #%d) failed: %s", ticket.id, ticket.env, ticket.index, e)
            self.counts["errored_groups"] += 1
            ticket.rollouts = None
        if self.running.pop(ticket.id, None) is None:
            return
        ticket.finished_at = self.clock()
        if ticket.trace.lost:
            self.counts["redispatched"] += 1
            self.requeued.appendleft((ticket.env, ticket.index))
        elif ticket.rollouts is not None and ticket.oldest is not None and ticket.oldest < self.bound:
            # Its first request started after the cut that moved the bound past the served version (it was
            # dispatched earlier, so `enforce_bound` saw no request of it to judge): too old for any step to come.
            self.counts["dropped_stale"] += 1
        elif ticket.rollouts is not None:
            self.done.append(ticket)
        await self._notify()

    def enforce_bound(self) -> None:
        """Cancel running groups and drop finished ones whose oldest request is older than the bound."""
        bound = self.bound
        for ticket in [t for t in self.running.values() if t.oldest is not None and t.oldest < bound]:
            del self.running[ticket.id]
            ticket.task.cancel()
            self.counts["cancelled_stale"] += 1
        stale = [t for t in self.done if t.oldest is not None and t.oldest < bound]
        for ticket in stale:
            self.done.remove(ticket)
            self.counts["dropped_stale"] += 1

    def restart_all(self) -> None:
        """Throw away every group not yet cut and dispatch its prompt again (the server lost its weights)."""
        for ticket in sorted([*self.done, *self.running.values()], key=lambda t: t.id, reverse=True):
            if ticket.task is not None and not ticket.task.done():
                ticket.task.cancel()
            self.requeued.appendleft((ticket.env, ticket.index))
            self.counts["redispatched"] += 1
        self.running.clear()
        self.done.clear()

    # ------------------------------------------------------------------------------------------ the cut

    async def cut(self, step: int) -> Cut:
        """Wait until finished groups hold `batch_size` trainable rollouts within step `step`'s bound, and take
        them (whole groups in finish order; the last may hold more than needed, cut_batch trims it)."""
        self.cut_step = step
        self.enforce_bound()
        self.start()
        start = self.clock()
        cond = self._condition()
        async with cond:
            cond.notify_all()
            await cond.wait_for(
                lambda: (
                    self._held(self.done) >= self._target() or self._empty() >= 2 * self.capacity
                )  # dispatch stopped: only failed groups (`_need`)
            )
        taken: list[Ticket] = []
        count = 0
        while count < self._target() and self.done:  # short only when the pool filled with failed groups
            ticket = self.done.popleft()
            taken.append(ticket)
            count += ticket.tokens if self.batch_tokens else ticket.trainable
        # Groups finished without a trainable rollout (all errored or filtered) are cut too: their rollouts
        # belong in this step's metrics, and they must not fill the pool.
        empty = [t for t in self.done if t.trainable == 0]
        for t in empty:
            self.done.remove(t)
        counts = {
            **self.counts,
            "in_flight": len(self.running),
            "carried": len(self.done),
            "capacity": self.capacity,
        }
        self.total.update(self.counts)
        self.counts = Counter()
        # From here on every group serves a later step: the next step's bound applies at once (to dispatch and
        # to the cancellations on the next update), not when the loop comes back for its cut.
        self.cut_step = step + 1
        await self._notify()
        return Cut(groups=[t.rollouts for t in [*taken, *empty]], wait_s=self.clock() - start, counts=counts)
