"""The request limiter (movable limit, priority order) and the AIMD controller's decisions on server metrics."""

from __future__ import annotations

import asyncio

from primejax.orchestrator.concurrency import (
    KV_USAGE,
    PREEMPTIONS,
    PRIORITY,
    WAITING,
    AIMDController,
    AIMDSettings,
    Limiter,
    parse_prometheus,
)

METRICS = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1"} nan
vllm:kv_cache_usage_perc garbage
vllm:num_requests_waiting
"""


def test_prometheus_text_sums_label_sets_and_skips_what_does_not_parse():
    m = parse_prometheus(METRICS)
    assert m == {KV_USAGE: 0.25, WAITING: 3.0, "vllm:num_requests_running": 7.0, PREEMPTIONS: 3.0}


def test_limiter_holds_the_limit_lets_lower_priority_numbers_first_and_follows_a_new_limit():
    async def main():
        limiter = Limiter(2)
        order, peak = [], [0]

        async def request(name: str, priority: int, hold: asyncio.Event):
            PRIORITY.set(priority)
            async with limiter:
                peak[0] = max(peak[0], limiter.in_flight)
                order.append(name)
                await hold.wait()

        hold = asyncio.Event()
        tasks = [asyncio.create_task(request(f"first{i}", 0, hold)) for i in range(2)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(request("new", 9, hold)), asyncio.create_task(request("old", 1, hold))]
        await asyncio.sleep(0)
        assert order == ["first0", "first1"] and limiter.saturated
        await limiter.set_limit(3)  # a raised limit lets the next waiter in at once: the older group's turn
        await asyncio.sleep(0)
        assert order[-1] == "old" and limiter.in_flight == 3
        hold.set()
        await asyncio.gather(*tasks)
        return order, peak[0], limiter.in_flight

    order, peak, left = asyncio.run(main())
    assert order == ["first0", "first1", "old", "new"] and peak == 3 and left == 0


def test_a_cancelled_waiter_gives_its_place_back():
    async def main():
        limiter = Limiter(1)
        gate = asyncio.Event()

        async def hold():
            async with limiter:
                await gate.wait()

        async def quick():
            async with limiter:
                return True

        first = asyncio.create_task(hold())
        await asyncio.sleep(0)
        waiting = asyncio.create_task(quick())
        await asyncio.sleep(0)
        waiting.cancel()
        gate.set()
        await asyncio.gather(first, waiting, return_exceptions=True)
        return await asyncio.wait_for(quick(), 1.0), limiter.in_flight

    assert asyncio.run(main()) == (True, 0)


def controller(limit: int) -> AIMDController:
    async def nothing():
        return []

    return AIMDController(Limiter(limit), AIMDSettings(floor=4, cap=40, increase=4, decrease=0.5), nothing)


def test_aimd_backs_off_multiplicatively_under_pressure_and_never_below_the_floor():
    c = controller(20)
    assert c.decide([{KV_USAGE: 0.95}]) == 10  # KV nearly full on one server
    assert c.decide([{KV_USAGE: 0.1}, {WAITING: 2.0}]) == 10  # a queue on another
    c.limiter._limit = 6
    assert c.decide([{WAITING: 5.0}]) == 4


def test_aimd_grows_additively_only_when_the_limit_was_reached():
    c = controller(20)
    calm = [{KV_USAGE: 0.3, WAITING: 0.0, PREEMPTIONS: 0.0}]
    assert c.decide(calm) == 20  # nothing waited for a slot: no reason to grow
    c.limiter.saturated = True
    assert c.decide(calm) == 24
    c.limiter._limit = 39
    assert c.decide(calm) == 40  # capped


def test_aimd_reads_new_preemptions_as_pressure_and_an_unreadable_fleet_as_no_news():
    c = controller(20)
    c.limiter.saturated = True
    assert c.decide([{PREEMPTIONS: 5.0}]) == 24  # the first look only learns the counter
    assert c.decide([{PREEMPTIONS: 7.0}]) == 10  # it moved: preemptions since the last look (20 x 0.5)
    assert c.decide([None]) == 20  # decide() proposes; tick() applies
