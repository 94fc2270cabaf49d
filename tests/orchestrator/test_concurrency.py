"""The request limiter (movable limit, priority order) and the AIMD controller's decisions on server metrics."""

from __future__ import annotations

import asyncio
import logging

import pytest

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


class _MetricsClient:
    """FakeClient plus a /metrics page per server (None = the server did not answer)."""

    def __init__(self, tokenizer, pages):
        from orch_fakes import FakeClient

        self.fake, self.pages, self.asked = FakeClient(tokenizer), pages, 0
        self.base_urls = [f"http://127.0.0.1:{8000 + i}" for i in range(len(pages))]

    def __getattr__(self, name):
        return getattr(self.fake, name)

    async def metrics_text(self):
        self.asked += 1
        return list(self.pages)


@pytest.mark.parametrize(
    ("pages", "mode"),
    [
        ([METRICS], "aimd"),  # vLLM's page
        ([None, METRICS], "aimd"),  # one replica down at start-up, the other exposes it
        (["# HELP http_requests_total\nhttp_requests_total 3\n"], "fixed"),  # a /metrics without vLLM's load
        ([None], "fixed"),  # no answer
        (None, "fixed"),  # a client without metrics_text
    ],
)
def test_auto_concurrency_is_aimd_when_a_server_exposes_vllm_metrics_and_fixed_otherwise(
    tmp_path, tokenizer, caplog, pages, mode
):
    from orch_fakes import FakeClient, make_orchestrator, small_config

    cfg = small_config(tmp_path / "run", max_concurrent=4)  # below the AIMD floor (8): auto caps the floor
    assert cfg.orchestrator.concurrency.mode == "auto"  # the default
    client = FakeClient(tokenizer) if pages is None else _MetricsClient(tokenizer, pages)
    orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=tmp_path / "run")
    assert orch.limiter.limit == 4 and orch.aimd is None  # nothing decided before the run starts
    with caplog.at_level(logging.INFO, logger="primejax.orchestrator.loop"):
        assert asyncio.run(orch.pick_concurrency()) == mode
        assert (
            asyncio.run(orch.pick_concurrency()) == mode
        )  # decided once: a second call neither asks nor logs
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("concurrency:")]
    assert (
        len(said) == 1
        and ("AIMD between 4 and 4" if mode == "aimd" else "fixed at max_concurrent = 4") in said[0]
    )
    assert getattr(client, "asked", 1) == 1
    if mode == "aimd":
        assert orch.aimd is not None and orch.aimd.s.floor == 4 and orch.aimd.s.cap == 4
    else:
        assert orch.aimd is None and orch.limiter.limit == 4


def test_auto_concurrency_starts_aimd_at_its_floor_under_a_higher_cap(tmp_path, tokenizer):
    from orch_fakes import make_orchestrator, small_config

    cfg = small_config(tmp_path / "run", max_concurrent=64)
    orch = make_orchestrator(
        cfg, client=_MetricsClient(tokenizer, [METRICS]), tokenizer=tokenizer, run_dir=tmp_path / "run"
    )
    assert orch.limiter.limit == 64
    assert asyncio.run(orch.pick_concurrency()) == "aimd"
    assert orch.limiter.limit == 8 and (orch.aimd.s.floor, orch.aimd.s.cap) == (8, 64)
