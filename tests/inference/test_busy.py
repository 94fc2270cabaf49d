"""Per-server busy fraction (primejax/inference/busy.py): what `server/<i>/busy` reports per step."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from primejax.inference.admin_auth import TOKEN_ENV
from primejax.inference.busy import BusyMeter
from primejax.inference.client import InferenceClient


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_overlapping_requests_count_once_and_idle_gaps_not_at_all():
    clock = Clock()
    m = BusyMeter(["a", "b"], clock=clock)
    m.started("a")  # t 100
    clock.t = 102
    m.started("a")  # overlaps the first: no extra busy time
    clock.t = 103
    m.finished("a")
    clock.t = 104
    m.finished("a")  # a busy 100..104
    clock.t = 106  # idle 104..106
    m.started("b")
    clock.t = 110
    m.finished("b")  # b busy 106..110
    assert m.take() == {"server/0/busy": 0.4, "server/1/busy": 0.4, "server/busy_mean": 0.4}


def test_a_request_outstanding_at_the_reading_counts_up_to_it_and_goes_on_counting():
    clock = Clock()
    m = BusyMeter(["a"], clock=clock)
    clock.t = 105
    m.started("a")
    clock.t = 110
    assert m.take()["server/0/busy"] == 0.5  # 105..110 of 100..110
    clock.t = 120
    m.finished("a")
    clock.t = 130
    assert m.take()["server/0/busy"] == 0.5  # 110..120 of 110..130
    clock.t = 140
    assert m.take()["server/0/busy"] == 0.0


@pytest.fixture(autouse=True)
def _no_run_secret(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def test_the_client_meters_the_server_its_request_went_to():
    release = asyncio.Event()
    clock = Clock()

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        await release.wait()
        return httpx.Response(
            200,
            json={
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "token_ids": [1],
                        "finish_reason": "stop",
                        "logprobs": {"token_logprobs": [-0.5]},
                    }
                ]
            },
        )

    async def go():
        async with InferenceClient(["http://a", "http://b"], transport=httpx.MockTransport(handler)) as c:
            c.busy = BusyMeter(c.base_urls, clock=clock)
            task = asyncio.create_task(c.generate([1, 2], n=1, max_tokens=1, temperature=1.0))
            while sum(c.busy.outstanding.values()) == 0:
                await asyncio.sleep(0)
            busy_url = next(u for u, n in c.busy.outstanding.items() if n)
            clock.t = 110
            reading = c.busy.take()
            release.set()
            await task
            clock.t = 120
            return busy_url, reading, c.busy.take()

    busy_url, during, after = asyncio.run(go())
    i = ["http://a", "http://b"].index(busy_url)
    assert during[f"server/{i}/busy"] == 1.0 and during[f"server/{1 - i}/busy"] == 0.0
    assert after[f"server/{i}/busy"] == 0.0  # finished at t 110, nothing since
