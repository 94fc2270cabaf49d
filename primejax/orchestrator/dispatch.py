"""How a step's groups are generated: two dispatch modes behind one interface (docs/rollouts.md).

`orchestrator.pool.mode` picks one, once, in `build_dispatch`; the loop (loop.py) only calls `groups(step)`:

* `BarrierDispatch` ("step"): wait until the policy is within the off-policy bound of the step, then generate
  its groups in one round (plus top-up rounds while online difficulty filtering or an enforcing pre-batch
  filter left the batch short); nothing runs between steps.
* `ContinuousDispatch` ("continuous"): a `RolloutPool` keeps groups in flight across steps; a step cuts the
  groups that finished first (pool.py).

Both redo their generation after an inference outage through the one retry loop (outages.StepRetry); each
says what it throws away first: the barrier rewinds the buffer and generates the same prompts again, the
pool dispatches every unfinished group again.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from primejax.orchestrator.buffer import Buffer
from primejax.orchestrator.config import OrchestratorConfig
from primejax.orchestrator.filters import FilterSlot
from primejax.orchestrator.outages import OutageCounter, StepRetry
from primejax.orchestrator.policy import PolicyTracker, min_policy_version
from primejax.orchestrator.pool import RolloutPool, RunGroup
from primejax.orchestrator.rollout import Rollout
from primejax.orchestrator.token_budget import TokenMeter

MAX_TOPUP_ROUNDS = 3  # extra generation rounds per step when online difficulty filtering left the batch short


@dataclass
class StepGroups:
    groups: list[list[Rollout]]
    waited: float  # seconds spent waiting: for the policy (barrier) or for the cut (continuous)
    generate_s: float  # seconds from the end of the wait (barrier) or the start (continuous) to the groups
    metrics: dict[str, float] = field(default_factory=dict)
    phases: list[tuple[str, float]] = field(default_factory=list)  # the step's timeline, in order


async def _inline(fn: Any, *args: Any) -> Any:
    return fn(*args)


class Dispatch:
    """The interface the loop sees. `offload(fn, *args)` runs the step's CPU work on the batch (packing,
    writing): on the event loop when nothing else is in flight, in a thread when groups are."""

    offload: Callable[..., Awaitable[Any]] = staticmethod(_inline)

    async def groups(self, step: int) -> StepGroups:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], envs: Any) -> None:
        """`envs`: the names the run still has (a resumed run may have dropped some)."""

    async def stop(self) -> None:
        pass


class BarrierDispatch(Dispatch):
    """Step mode: `batch_size / group_size * oversampling_factor` groups per round, all at once."""

    def __init__(
        self,
        o: OrchestratorConfig,
        *,
        run_group: RunGroup,
        buffer: Buffer,
        tracker: PolicyTracker,
        outages: OutageCounter,
        retry: StepRetry,
        pre_filters: FilterSlot,
        pre_counts: Counter,
    ):
        self.o, self.run_group, self.buffer, self.tracker = o, run_group, buffer, tracker
        self.outages, self.retry, self.pre_filters, self.pre_counts = outages, retry, pre_filters, pre_counts

    async def generate(self, step: int) -> list[list[Rollout]]:
        """With online difficulty filtering (or an enforcing pre-batch slot), more rounds (sized the same way)
        while the dropped groups leave fewer than `batch_size` trainable rollouts."""
        o = self.o
        self.pre_counts.clear()  # an attempt redone after an outage counts afresh
        replaces = o.buffer.online_difficulty_filtering or self.pre_filters.enforce
        rounds = 1 + (MAX_TOPUP_ROUNDS if replaces or o.batch_tokens else 0)
        groups: list[list[Rollout]] = []
        missing = o.batch_size
        meter, tokens = (
            TokenMeter(o.seq_len),
            0,
        )  # batch_tokens: rounds until the budget is covered (token_budget.py)
        for _ in range(rounds):
            prompts = self.buffer.sample(math.ceil(missing / o.group_size * o.buffer.oversampling_factor))
            new = await asyncio.gather(
                *(self.run_group(env, index, len(groups) + i, step) for i, (env, index) in enumerate(prompts))
            )
            groups += new
            if o.batch_tokens:
                tokens += sum(meter.observe(g) for g in new)
                missing = (
                    0
                    if tokens >= o.batch_tokens
                    else meter.rollouts_for(o.batch_tokens - tokens, o.batch_size)
                )
            else:
                missing = o.batch_size - sum(r.ok and not r.dropped for g in groups for r in g)
            if missing <= 0:
                break
        return groups

    async def groups(self, step: int) -> StepGroups:
        waited = await self.tracker.wait_for(min_policy_version(step, self.o.async_level))
        t0 = time.perf_counter()
        rewind: dict[str, Any] = {}

        async def attempt() -> tuple[list[list[Rollout]] | None, str | None]:
            rewind["buffer"] = self.buffer.state_dict()  # the same prompts again after an outage
            lost_before = self.outages.count
            groups = await self.generate(step)
            if self.outages.count > lost_before:
                return None, f"{self.outages.count - lost_before} requests lost"
            if not await self.tracker.server_matches():
                return None, "the server restarted (it no longer serves the tracked weights)"
            return groups, None

        groups = await self.retry.run(
            step,
            attempt,
            lambda: self.buffer.load_state_dict(rewind["buffer"]),
            redo="generating the step again once the server is back",
            resync_first=True,
        )
        gen = time.perf_counter() - t0
        return StepGroups(groups, waited, gen, phases=[("wait_for_weights", waited), ("generate", gen)])


def _env_caps(buffer: Buffer) -> dict[str, int] | None:
    """Every env's limits.max_concurrent, when any env sets one (the pool keeps within them)."""
    caps = {
        name: slot.limits.config.max_concurrent if slot.limits is not None else 0
        for name, slot in buffer.envs.items()
    }
    return caps if any(caps.values()) else None


class ContinuousDispatch(Dispatch):
    """Continuous mode: the pool runs groups across steps; a step cuts the first finished."""

    offload = staticmethod(asyncio.to_thread)  # groups in flight keep the event loop (loop_lag/*)

    def __init__(
        self,
        o: OrchestratorConfig,
        *,
        run_group: RunGroup,
        buffer: Buffer,
        tracker: PolicyTracker,
        outages: OutageCounter,
        retry: StepRetry,
        client: Any,
    ):
        capacity = o.pool.groups_in_flight or math.ceil(
            2 * o.batch_size / o.group_size * o.buffer.oversampling_factor
        )
        self.pool = RolloutPool(
            run_group,
            buffer.sample,
            tracker,
            batch_size=o.batch_size,
            group_size=o.group_size,
            async_level=o.async_level,
            capacity=capacity,
            oversampling=o.buffer.oversampling_factor,
            group_timeout_s=o.pool.group_timeout_s,
            batch_tokens=o.batch_tokens,
            seq_len=o.seq_len,
            env_caps=_env_caps(buffer),
        )
        self.tracker, self.outages, self.retry = tracker, outages, retry
        # One server: a lost request may mean it restarted on the base weights, and groups sampled there since
        # carry the old tags; several: the tracker routes around a replica until it is back on the weights.
        self.single_server = len(getattr(client, "base_urls", ())) <= 1
        self._lost_seen = 0  # requests lost to the server up to the last cut

    async def groups(self, step: int) -> StepGroups:
        """Step `step`'s groups cut from the pool, on a server known to serve the tracked policy. A server that
        restarted or lost requests has made every group not yet cut suspect: all are dispatched again."""
        t0 = time.perf_counter()

        async def attempt() -> tuple[tuple[list[list[Rollout]], dict[str, float]] | None, str | None]:
            lost_before = self.outages.count
            cut = await self.pool.cut(step)
            if self.single_server and self.outages.count > self._lost_seen:
                self._lost_seen = self.outages.count
                reason = f"{self.outages.count - lost_before} requests lost"
            elif await self.tracker.server_matches():
                metrics = {f"pool/{k}": float(v) for k, v in cut.counts.items()}
                metrics["time/batch_cut_wait"] = cut.wait_s
                return (cut.groups, metrics), None
            else:
                reason = "the server restarted (it no longer serves the tracked weights)"
            self.pool.requeue([(g[0].env, g[0].example_index) for g in cut.groups if g])
            return None, reason

        groups, metrics = await self.retry.run(
            step,
            attempt,
            self.pool.restart_all,
            redo="every unfinished group is dispatched again",
            resync_first=False,
        )
        gen = time.perf_counter() - t0
        return StepGroups(groups, metrics["time/batch_cut_wait"], gen, metrics, phases=[("batch_cut", gen)])

    def state_dict(self) -> dict[str, Any]:
        return {"pending": [list(p) for p in self.pool.pending_prompts()]}  # dispatched again first on resume

    def load_state_dict(self, state: dict[str, Any], envs: Any) -> None:
        self.pool.requeue([(e, i) for e, i in state.get("pending", []) if e in envs])

    async def stop(self) -> None:
        await self.pool.stop()


def build_dispatch(
    o: OrchestratorConfig,
    *,
    run_group: RunGroup,
    buffer: Buffer,
    tracker: PolicyTracker,
    outages: OutageCounter,
    retry: StepRetry,
    pre_filters: FilterSlot,
    pre_counts: Counter,
    client: Any,
) -> Dispatch:
    """The mode `orchestrator.pool.mode` names."""
    common = dict(run_group=run_group, buffer=buffer, tracker=tracker, outages=outages, retry=retry)
    if o.pool.mode == "continuous":
        return ContinuousDispatch(o, client=client, **common)
    return BarrierDispatch(o, pre_filters=pre_filters, pre_counts=pre_counts, **common)
