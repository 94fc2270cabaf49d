"""InferenceClient against scripted HTTP servers (httpx.MockTransport): parsing, retries, balancing."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from primejax.inference.admin_auth import TOKEN_ENV
from primejax.inference.client import InferenceClient
from primejax.inference.server_pool import InferenceError

COMPLETION = {
    "choices": [
        {
            "index": 1,
            "text": "b",
            "token_ids": [7, 2],
            "finish_reason": "stop",
            "logprobs": {"token_logprobs": [-0.5, -0.25]},
            "prompt_token_ids": [1, 2, 3],
        },
        {
            "index": 0,
            "text": "a",
            "token_ids": [5, 6],
            "finish_reason": "length",
            "logprobs": {"token_logprobs": [-1.0, -2.0]},
            "prompt_token_ids": [1, 2, 3],
        },
    ]
}
MODELS = {"data": [{"id": "served-model"}]}


@pytest.fixture(autouse=True)
def _no_run_secret(monkeypatch):
    """These scripted servers test parsing and retries; the identity challenge (which needs the run's secret,
    set in this process by any test that started a server) has its own tests (tests/hardening)."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def _client(handler, urls=("http://a",), **kw) -> InferenceClient:
    return InferenceClient(list(urls), transport=httpx.MockTransport(handler), backoff_s=0.0, **kw)


def test_generate_parses_samples_in_index_order_and_sends_token_prompt():
    seen = {}

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        seen.update(json.loads(req.content))
        return httpx.Response(200, json=COMPLETION)

    async def go():
        async with _client(handler) as c:
            return await c.generate([1, 2, 3], n=2, max_tokens=2, temperature=0.7, seed=5)

    out = asyncio.run(go())
    assert [o.completion_token_ids for o in out] == [[5, 6], [7, 2]]
    assert out[0].completion_logprobs == [-1.0, -2.0] and out[1].finish_reason == "stop"
    assert (
        seen["prompt"] == [1, 2, 3] and seen["model"] == "served-model" and seen["return_token_ids"] is True
    )
    assert seen["temperature"] == 0.7 and seen["n"] == 2 and seen["seed"] == 5 and seen["logprobs"] == 0


def test_retries_connection_errors_and_5xx_then_succeeds():
    attempts = []

    def handler(req):
        attempts.append(req.url.path)
        if len(attempts) == 1:
            raise httpx.ConnectError("refused")
        if len(attempts) == 2:
            return httpx.Response(503, json={"error": "busy"})
        return httpx.Response(200, json={"version": 3, "weight_dir": "/x"})

    async def go():
        async with _client(handler, max_retries=3) as c:
            return await c.weights_version()

    assert asyncio.run(go()) == 3 and len(attempts) == 3


def test_gives_up_after_max_retries():
    def handler(req):
        return httpx.Response(500, json={"error": "boom"})

    async def go():
        async with _client(handler, max_retries=2) as c:
            await c.reload_weights()

    with pytest.raises(InferenceError, match="after 3 attempts.*boom"):
        asyncio.run(go())


def test_4xx_is_not_retried_and_carries_the_server_message():
    calls = []

    def handler(req):
        calls.append(1)
        return httpx.Response(422, json={"error": "shape mismatch; still serving version 2"})

    async def go():
        async with _client(handler) as c:
            await c.update_weights("/w/step_3", 3)

    with pytest.raises(InferenceError) as e:
        asyncio.run(go())
    assert e.value.status == 422 and "still serving version 2" in str(e.value) and len(calls) == 1


def test_admin_calls_reach_every_server_and_version_is_the_minimum():
    hits = []

    def handler(req):
        hits.append((req.url.host, req.url.path))
        if req.url.path == "/weights_version":
            return httpx.Response(200, json={"version": {"a": 5, "b": 4}[req.url.host]})
        return httpx.Response(200, json={"version": 6})

    async def go():
        async with _client(handler, urls=("http://a", "http://b")) as c:
            await c.update_weights("/w/step_6", 6)
            return await c.weights_version()

    assert asyncio.run(go()) == 4
    assert {("a", "/update_weights"), ("b", "/update_weights")} <= set(hits)


def test_generation_is_spread_over_servers():
    per_host = {"a": 0, "b": 0}

    async def handler(req):
        if req.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        per_host[req.url.host] += 1
        await asyncio.sleep(0.01)  # keep requests overlapping so in-flight counts matter
        return httpx.Response(200, json=COMPLETION)

    async def go():
        async with _client(handler, urls=("http://a", "http://b"), model="m") as c:
            await asyncio.gather(*(c.generate([1], n=2, max_tokens=2, temperature=1.0) for _ in range(20)))

    asyncio.run(go())
    assert per_host == {"a": 10, "b": 10}


def test_score_maps_prompt_logprobs_by_token():
    def handler(req):
        return httpx.Response(
            200,
            json={
                "choices": [
                    {
                        "prompt_logprobs": [
                            None,
                            {"9": {"logprob": -1.5}, "4": {"logprob": -0.1}},
                            {"3": {"logprob": -2.0}},
                        ]
                    }
                ]
            },
        )

    async def go():
        async with _client(handler, model="m") as c:
            return await c.score([1, 9, 3])

    assert asyncio.run(go()) == [None, -1.5, -2.0]


def test_a_rollouts_turns_stay_on_one_replica_and_new_rollouts_go_to_the_least_loaded():
    from primejax.inference.client import sticky_route

    hits: list[str] = []

    async def handler(req):
        if req.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        hits.append(req.url.host)
        await asyncio.sleep(0.01)
        return httpx.Response(200, json=COMPLETION)

    async def rollout(c, turns: int) -> None:
        sticky_route()
        for _ in range(turns):
            await c.generate([1, 2, 3], n=2, max_tokens=2, temperature=1.0)

    async def go():
        async with InferenceClient(
            ["http://a", "http://b"], transport=httpx.AsyncBaseTransport(), backoff_s=0.0
        ) as c:
            c._http._transport = httpx.MockTransport(handler)
            tasks = [asyncio.create_task(rollout(c, 3)) for _ in range(2)]
            await asyncio.gather(*tasks)

    asyncio.run(go())
    # Two rollouts started together: one per replica (least loaded), each one's three turns on its own.
    assert sorted(hits) == ["a"] * 3 + ["b"] * 3
    assert hits[:2] in (["a", "b"], ["b", "a"])


def test_a_sticky_rollout_reaches_a_second_clients_own_server():
    """An opd rollout samples from the policy and scores on the teacher inside one sticky route: the teacher's
    client must pick among its own servers, not follow the route the policy's client set."""
    from primejax.inference.client import sticky_route

    hits: list[str] = []

    def handler(req):
        if req.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        hits.append(req.url.host)
        if req.url.host == "teacher":
            return httpx.Response(
                200, json={"choices": [{"prompt_logprobs": [None, {"2": {"logprob": -0.5}}]}]}
            )
        return httpx.Response(200, json=COMPLETION)

    async def go():
        async with (
            _client(handler, urls=("http://policy",)) as policy,
            _client(handler, urls=("http://teacher",)) as teacher,
        ):
            sticky_route()
            await policy.generate([1, 2, 3], n=2, max_tokens=2, temperature=1.0)
            scores = await teacher.score([1, 2])
            await policy.generate([1, 2, 3], n=2, max_tokens=2, temperature=1.0)
            return scores

    assert asyncio.run(go()) == [None, -0.5]
    assert hits == ["policy", "teacher", "policy"]


def test_a_replica_that_fails_is_routed_around_until_revived():
    dead = {"b"}

    def handler(req):
        if req.url.host in dead:
            raise httpx.ConnectError("refused")
        if req.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        if req.url.path == "/weights_version":
            return httpx.Response(200, json={"version": 2})
        return httpx.Response(200, json=COMPLETION)

    async def go():
        async with _client(handler, urls=("http://a", "http://b"), max_retries=0) as c:
            outcomes = []
            for _ in range(6):
                try:
                    await c.generate([1, 2, 3], n=2, max_tokens=2, temperature=1.0)
                    outcomes.append("ok")
                except InferenceError:
                    outcomes.append("lost")
            down = set(c.down)
            version = await c.weights_version()  # admin calls skip the down replica
            alive_while_dead = await c.alive("http://b")
            dead.clear()
            alive_after = await c.alive("http://b")
            await c.revive("http://b")
            return outcomes, down, version, alive_while_dead, alive_after, set(c.down)

    outcomes, down, version, alive_while_dead, alive_after, down_after = asyncio.run(go())
    # Only the one request that found it dead is lost (the caller redoes it); every later one goes to "a".
    assert outcomes.count("lost") == 1 and outcomes[outcomes.index("lost") + 1 :] == ["ok"] * (
        5 - outcomes.index("lost")
    )
    assert down == {"http://b"} and version == 2
    assert not alive_while_dead and alive_after
    assert down_after == set()


def test_a_metrics_page_is_read_only_up_to_its_bound_and_parsed_off_the_loop():
    """Issue 48: AIMD read /metrics whole on the event loop (a 100 MB page: 86 s, 717 MB). The client stops at
    MAX_METRICS_BYTES and hands back None for that server; a normal page comes back undecoded, and the
    orchestrator parses it in a thread (`parse_pages`)."""
    import threading

    from primejax.inference.client import MAX_METRICS_BYTES
    from primejax.orchestrator.concurrency import KV_USAGE, parse_pages

    sent = {"http://big": 0}
    chunk = b"# " + b"x" * (1 << 20) + b"\n"

    async def endless():
        for _ in range(64):  # 64 MiB if read whole
            sent["http://big"] += len(chunk)
            yield chunk

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "big":
            return httpx.Response(200, content=endless())
        return httpx.Response(200, content=f'{KV_USAGE}{{engine="0"}} 0.5\n'.encode())

    async def main():
        async with _client(handler, urls=("http://big", "http://ok")) as c:
            pages = await c.metrics_text()
            where = []

            def parse(p):
                where.append(threading.current_thread() is threading.main_thread())
                return parse_pages(p)

            return pages, await asyncio.to_thread(parse, pages), where

    pages, parsed, where = asyncio.run(main())
    assert pages[0] is None and sent["http://big"] <= MAX_METRICS_BYTES + 2 * len(chunk)
    assert parsed == [None, {KV_USAGE: 0.5}] and where == [False]


def test_metrics_are_not_read_from_a_server_that_fails_the_identity_check(monkeypatch):
    """Issue 48: /metrics was read from whatever answered on the address; now it is the same challenge as every
    request, and a server that is not the run's gives no metrics (None) instead of steering the limit."""
    monkeypatch.setenv(TOKEN_ENV, "the-runs-secret")
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/identity":
            return httpx.Response(404)
        return httpx.Response(200, content=b"vllm:num_requests_waiting 1000\n")

    async def main():
        async with _client(handler) as c:
            return await c.metrics_text()

    assert asyncio.run(main()) == [None]
    assert seen == ["/identity"]
