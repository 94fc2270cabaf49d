"""The servers' per-step metrics from their Prometheus pages: rates from counters over the step's wall time,
gauges averaged over the step's readings, counter resets, unreadable servers and hostile pages."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from primejax.orchestrator.server_stats import ServerStats, step_metrics


def page(gen: float, prompt: float, kv: float, running: float, waiting: float, preempt: float) -> str:
    """A vLLM-style page: two engines' label sets per metric (summed), counters with their _total suffix."""
    half = lambda v: v / 2  # noqa: E731
    lines = [
        "# HELP vllm:generation_tokens Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens counter",
    ]
    for engine in ("0", "1"):
        lines += [
            f'vllm:generation_tokens_total{{engine="{engine}"}} {half(gen)}',
            f'vllm:prompt_tokens_total{{engine="{engine}"}} {half(prompt)}',
            f'vllm:prompt_tokens_by_source_total{{engine="{engine}",source="x"}} 1e9',  # not prompt_tokens
            f'vllm:kv_cache_usage_perc{{engine="{engine}"}} {half(kv)}',
            f'vllm:num_requests_running{{engine="{engine}"}} {half(running)}',
            f'vllm:num_requests_waiting{{engine="{engine}"}} {half(waiting)}',
            f'vllm:num_preemptions_total{{engine="{engine}"}} {half(preempt)}',
        ]
    return "\n".join(lines)


def parsed(text):
    from primejax.orchestrator.concurrency import parse_prometheus
    from primejax.orchestrator.server_stats import NAMES

    return parse_prometheus(text, NAMES)


def test_rates_gauges_resets_and_weight_loads_over_two_replicas():
    start = (10.0, [parsed(page(1000, 4000, 0.1, 0, 0, 2)), parsed(page(500, 100, 0.0, 0, 0, 7))])
    readings = [
        (11.0, [parsed(page(1200, 4400, 0.4, 6, 2, 2)), None]),  # replica 1 unreadable here
        (14.0, [parsed(page(1600, 5200, 0.2, 2, 0, 3)), parsed(page(30, 20, 0.5, 4, 1, 1))]),  # 1 restarted
    ]
    m = step_metrics(start, readings, {0: 0.25, 1: 0.5})
    expected = {
        "server/0/gen_tokens_per_s": 600 / 4,
        "server/0/prompt_tokens_per_s": 1200 / 4,
        "server/0/kv_cache_usage": 0.3,
        "server/0/kv_cache_usage_max": 0.4,
        "server/0/running": 4.0,
        "server/0/waiting": 1.0,
        "server/0/preemptions": 1.0,
        "server/0/weight_update_s": 0.25,
        # replica 1's counters went down (it restarted): what it counts since then is the step's increase
        "server/1/gen_tokens_per_s": 30 / 4,
        "server/1/prompt_tokens_per_s": 20 / 4,
        "server/1/kv_cache_usage": 0.5,
        "server/1/kv_cache_usage_max": 0.5,
        "server/1/running": 4.0,
        "server/1/waiting": 1.0,
        "server/1/preemptions": 1.0,
        "server/1/weight_update_s": 0.5,
        "server/total/gen_tokens_per_s": 157.5,
        "server/total/prompt_tokens_per_s": 305.0,
        "server/total/running": 8.0,
        "server/total/waiting": 2.0,
        "server/total/preemptions": 2.0,
        "server/total/weight_update_s": 0.75,
        "server/max/kv_cache_usage": 0.5,
    }
    assert m.keys() == expected.keys()
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, rel=1e-12), k


def test_a_server_unreadable_at_the_step_end_gets_no_rates_and_hostile_pages_give_nothing():
    start = (0.0, [parsed(page(0, 0, 0, 0, 0, 0))])
    garbage = parsed(
        "vllm:generation_tokens_total nan\nvllm:prompt_tokens_total\n"
        + "x" * 10_000
        + '\nvllm:num_requests_running{engine="0"} inf\nvllm:kv_cache_usage_perc not-a-number'
    )
    assert garbage == {}
    m = step_metrics(start, [(1.0, [garbage])])
    assert m == {}  # nothing known about it: no invented zeros
    assert step_metrics(start, [(1.0, [None])]) == {}


class Pages:
    """A fake fleet of one server whose counters grow by 100 generated tokens per clock second; its pages come as
    the client reads them, undecoded bytes (one line not UTF-8)."""

    def __init__(self):
        self.now = 0.0
        self.fail = False

    def clock(self):
        return self.now

    async def read(self):
        if self.fail:
            raise OSError("connection refused")
        return [b"# \xff not utf-8\n" + page(100 * self.now, 10 * self.now, 0.5, 3, 0, 0).encode()]


def test_each_step_is_measured_from_the_previous_steps_end():
    pages = Pages()
    stats = ServerStats(pages.read, poll_s=0, clock=pages.clock)

    async def main():
        await stats.take()  # the orchestrator's baseline reading before its first step
        out = []
        for dt in (2.0, 5.0):
            pages.now += dt
            out.append(await stats.take())
        stats.weight_loads({0: 1.5})
        pages.fail = True
        out.append(await stats.take())  # unreadable: the step keeps its weight-load figure only
        pages.fail = False
        pages.now += 1.0
        out.append(await stats.take())  # measured from the last good reading on
        return out

    first, second, failed, after = asyncio.run(main())
    assert first["server/0/gen_tokens_per_s"] == pytest.approx(100.0) and first["server/0/running"] == 3.0
    assert second["server/0/gen_tokens_per_s"] == pytest.approx(100.0)
    assert failed == {"server/0/weight_update_s": 1.5, "server/total/weight_update_s": 1.5}
    # The failed step left the start at the previous good reading: the rate spans both steps' time.
    assert after["server/0/gen_tokens_per_s"] == pytest.approx(100.0)


def test_each_servers_own_load_seconds_are_kept_per_server_and_insane_figures_dropped(monkeypatch):
    """The client keeps what each server said its last weight load took (`load_seconds` of its answer), which
    becomes server/<i>/weight_update_s; a figure that is not a finite, non-negative number (or is a bool) is
    dropped, not logged."""
    from primejax.inference.admin_auth import TOKEN_ENV
    from primejax.inference.client import InferenceClient

    monkeypatch.delenv(TOKEN_ENV, raising=False)  # scripted servers: no identity challenge
    said = {"a": 0.25, "b": float("nan"), "c": -1.0, "d": True, "e": "3", "f": None}

    def handler(req):
        return httpx.Response(
            200,
            content=json.dumps({"version": 2, "load_seconds": said[req.url.host]}),
            headers={"content-type": "application/json"},
        )

    async def go():
        async with InferenceClient(
            [f"http://{h}" for h in said], transport=httpx.MockTransport(handler)
        ) as c:
            await c.update_weights("/w/step_2", 2)
            return c.last_load_seconds

    assert asyncio.run(go()) == {"http://a": 0.25}
