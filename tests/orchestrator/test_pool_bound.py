"""The continuous pool's bound for a group dispatched before a cut but whose first request starts after it:
the cut moved the bound past the served version, so the request samples a policy too old for any step to come
(seen on two real vLLM-CPU replicas: a step-14 batch held θ_11 with async_level 1, bound θ_12)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from primejax.orchestrator.group_trace import TRACE
from primejax.orchestrator.pool import RolloutPool


@dataclass
class Done:
    version: int
    ok: bool = True
    dropped: bool = False


class Policy:
    def __init__(self):
        self.version = 0
        self._changed = asyncio.Event()

    async def wait_for(self, v: int) -> int:
        while self.version < v:
            self._changed.clear()
            await self._changed.wait()
        return self.version

    def publish(self, v: int) -> None:
        self.version = v
        self._changed.set()


def test_a_group_whose_first_request_starts_below_the_bound_is_never_cut():
    async def main():
        policy = Policy()
        gates: dict[int, asyncio.Event] = {}

        async def run_group(env, index, group_id, step):
            gate = gates.setdefault(group_id, asyncio.Event())
            await gate.wait()  # dispatched, no request yet
            TRACE.get().versions.append(policy.version)  # what the generator notes as the request starts
            return [Done(policy.version)]

        pool = RolloutPool(
            run_group,
            lambda n: [("env", i) for i in range(n)],
            policy,
            batch_size=1,
            group_size=1,
            async_level=1,
            capacity=2,
        )
        first = asyncio.create_task(pool.cut(1))  # bound θ_0; dispatches groups 0 and 1
        while len(pool.running) < 2:
            await asyncio.sleep(0)
        gates.setdefault(0, asyncio.Event()).set()
        assert [g[0].version for g in (await first).groups] == [0]
        # Step 3's bound is θ_1 while the server still serves θ_0; group 1 has made no request yet.
        third = asyncio.create_task(pool.cut(3))
        await asyncio.sleep(0)
        gates.setdefault(1, asyncio.Event()).set()  # its request starts now, at θ_0
        for _ in range(20):
            await asyncio.sleep(0)
        assert not third.done(), "a θ_0 sample must not reach step 3 (bound θ_1)"
        policy.publish(1)  # θ_1 arrives: new groups are dispatched and sample it
        while not third.done():
            for gid in list(pool.running):
                gates.setdefault(gid, asyncio.Event()).set()
            await asyncio.sleep(0)
        cut = third.result()
        await pool.stop()
        return cut, pool.total

    cut, total = asyncio.run(main())
    assert [g[0].version for g in cut.groups] == [1]
    assert cut.counts["dropped_stale"] == 1


def _gated_pool(policy, gates, *, capacity, batch_size=1, async_level=1, oversampling=1.0):
    async def run_group(env, index, group_id, step):
        await gates.setdefault(group_id, asyncio.Event()).wait()
        TRACE.get().versions.append(policy.version)
        return [Done(policy.version)]

    return RolloutPool(
        run_group,
        lambda n: [("env", i) for i in range(n)],
        policy,
        batch_size=batch_size,
        group_size=1,
        async_level=async_level,
        capacity=capacity,
        oversampling=oversampling,
    )


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_running_groups_count_toward_the_steps_a_new_group_could_still_serve():
    """Trainer at the bound (step 2 cut while θ_0 is served, k = 1): a group started now serves step 2 only,
    so one group is started while it runs (counting finished groups only, the pool refilled to `capacity`: 4);
    after the cut the next step's bound (θ_1) is above the served version and nothing more starts."""

    async def main():
        policy, gates = Policy(), {}
        pool = _gated_pool(policy, gates, capacity=4)
        cut = asyncio.create_task(pool.cut(2))
        await _settle()
        running = len(pool.running)
        for gate in [gates.setdefault(i, asyncio.Event()) for i in range(pool._next_id)]:
            gate.set()
        await cut
        await _settle()
        dispatched = pool.total["dispatched"] + pool.counts["dispatched"]
        await pool.stop()
        return running, dispatched

    assert asyncio.run(main()) == (1, 1)


def test_a_refill_is_capped_at_what_the_uncovered_steps_need():
    """Step 1 cut with θ_0 served and k = 1: a group started now can serve steps 1 and 2, 2 rollouts each, so 4
    groups start, not `capacity` (8) of which the bound would cancel half; the oversampling factor scales it."""

    async def main(oversampling):
        policy, gates = Policy(), {}
        pool = _gated_pool(policy, gates, capacity=8, batch_size=2, oversampling=oversampling)
        cut = asyncio.create_task(pool.cut(1))
        await _settle()
        running = len(pool.running)
        cut.cancel()
        await asyncio.gather(cut, return_exceptions=True)
        await pool.stop()
        return running

    assert asyncio.run(main(1.0)) == 4
    assert asyncio.run(main(1.5)) == 6
