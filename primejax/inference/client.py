"""`InferenceClient`, async client for one or more primejax inference servers; here: sampling and its routing.

Token-level throughout: prompts go in as token ids and every sample comes back with its exact prompt ids,
completion ids and the sampling logprob of each completion token, taken after temperature (the server
runs with `--logprobs-mode processed_logprobs`), which is what the trainer's importance ratio needs.

Generation requests are spread over the servers (least in-flight first), and the turns of one rollout stay on
the server its first request went to (its prompt prefix is cached there): the orchestrator opens a route per
group with `sticky_route()`, and every request made in that context (its tasks inherit it) follows it. A server
whose request failed for good (unreachable, 5xx after retries) is marked down and routed around.

`InferenceClient` is built in three layers, one module each: `ServerPool` (server_pool.py: retries with
backoff, 4xx as `InferenceError`, identity checks, servers down and revived), `ServerAdmin` (server_admin.py:
weight updates, pause/resume and versions on every server) and, here, sampling.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import os
import random
from dataclasses import dataclass
from typing import Any

import httpx

from primejax.inference.busy import BusyMeter
from primejax.inference.identity import ServerIdentityError
from primejax.inference.routed_experts import request_fields as routed_request_fields
from primejax.inference.server_admin import ServerAdmin
from primejax.inference.server_pool import InferenceError

# One logger for the whole client (pool, admin calls, sampling): a level or filter set on it covers all its records.
logger = logging.getLogger("primejax.inference.client")
#: The longest /metrics page read (vLLM's is tens of kB; each LoRA adapter and histogram adds some).
MAX_METRICS_BYTES = 4 << 20


#: The server each client sends the current rollout's turns to (empty until a client's first request picks one);
#: see sticky_route(). Keyed by client: a rollout also talks to other clients (an opd teacher, a frozen source)
#: whose servers are not the policy's.
_ROUTE: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar("primejax_route", default=None)


def sticky_route() -> None:
    """Keep every later request of the calling task (and the tasks it starts) on one server per client."""
    _ROUTE.set({})


@dataclass
class Completion:
    """One sample."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]  # log p(token) under the sampling distribution (after temperature)
    finish_reason: str  # "stop" | "length" | "abort"
    text: str
    # Base64 .npy of the experts each completion token was routed to (asked with routed_experts=True; see
    # inference/routed_experts.py), None otherwise.
    routed_experts: str | None = None


class InferenceClient(ServerAdmin):
    def __init__(
        self,
        base_urls: str | list[str] | tuple[str, ...],
        *,
        timeout_s: float = 600.0,
        max_retries: int = 5,
        model: str | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        vocab_size: int | None = None,
        admin_token: str | None = None,
        api_key: str | None = None,
        api_key_var: str = "",
    ):
        """`vocab_size`: sampled token ids must lie below it (the model's embedding rows), checked per answer.
        `admin_token`: the servers' admin secret (default $PRIMEJAX_ADMIN_TOKEN), sent on admin calls only.
        `api_key`: the servers' OpenAI API key (vLLM's --api-key), sent as a bearer token on every call;
        `api_key_var`: the environment variable holding it (read when `api_key` is None), also handed to the clients
        environments open themselves (`Endpoint.api_key_var`), so every client reads one source."""
        self.api_key_var = api_key_var
        if api_key is None and api_key_var:
            api_key = os.environ.get(api_key_var) or None
        super().__init__(
            base_urls,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            transport=transport,
            admin_token=admin_token,
            api_key=api_key,
        )
        self._model = model
        self.vocab_size = vocab_size
        self.busy = BusyMeter(self.base_urls)  # requests outstanding per server, and their busy time

    async def openai_endpoint(self) -> tuple[str, str]:
        """(server root URL, served model name) of the least-loaded server, for an environment that samples
        through a client of its own (verifiers' own rollout loop)."""
        url = self._pick()
        return url, await self._model_name(url)

    # ---------------------------------------------------------------- routing
    def _pick(self) -> str:
        route = _ROUTE.get()
        held = None if route is None else route.get(id(self))
        if held is not None and held not in self.down:
            return held
        up = {u: n for u, n in self.busy.outstanding.items() if u not in self.down}
        if not up:
            raise InferenceError(f"no inference server is up (down: {sorted(self.down)})")
        least = min(up.values())
        url = random.choice([u for u, n in up.items() if n == least])
        if route is not None:
            route[id(self)] = url
        return url

    async def _balanced(self, path: str, payload: dict, check: bool = False) -> Any:
        url = self._pick()
        self.busy.started(url)
        try:
            try:
                if "model" not in payload:
                    payload = {"model": await self._model_name(url), **payload}
                out = await self._request("POST", url, path, payload)
            except InferenceError as e:
                if e.status is None or e.status >= 500:
                    self.mark_down(url, str(e)[:200])
                raise
            if check:
                self._check_samples(url, out)
            return out
        finally:
            self.busy.finished(url)

    def _check_samples(self, url: str, out: Any) -> None:
        """Reject an answer whose token ids lie outside the vocabulary or whose logprobs are not finite log
        probabilities here, naming the server, rather than as a bad batch deep in the trainer."""
        for c in out.get("choices") or []:
            ids = c.get("token_ids") or []
            bad = [
                t
                for t in ids
                if not isinstance(t, int) or t < 0 or (self.vocab_size and t >= self.vocab_size)
            ]
            if bad:
                raise InferenceError(
                    f"server {url} returned token id {bad[0]!r} outside the vocabulary "
                    f"[0, {self.vocab_size or 'vocab'})"
                )
            lp = c.get("logprobs") or {}
            values = lp.get("token_logprobs") or [t.get("logprob") for t in lp.get("content") or []]
            for v in values:
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v > 1e-3:
                    raise InferenceError(
                        f"server {url} returned sampling logprob {v!r} (not a finite log probability)"
                    )

    async def _model_name(self, url: str) -> str:
        if self._adapter:
            return self._adapter
        if self._model is None:
            models = await self._request("GET", url, "/v1/models")
            self._model = models["data"][0]["id"]
        return self._model

    # ---------------------------------------------------------------- generation
    async def generate(
        self,
        prompt_token_ids: list[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        routed_experts: bool = False,
    ) -> list[Completion]:
        """`n` samples continuing `prompt_token_ids` (no template applied). `routed_experts`: each sample also
        carries the experts its completion tokens were routed to (a server returning routed experts)."""
        payload: dict[str, Any] = {
            "prompt": list(prompt_token_ids),
            **_sampling(n, max_tokens, temperature, top_p, stop, seed, stop_token_ids),
            "logprobs": 0,  # the sampled token's logprob only
        }
        if routed_experts:
            payload.update(routed_request_fields(len(prompt_token_ids)))
        out = await self._balanced("/v1/completions", payload, check=True)
        completions = []
        for c in sorted(out["choices"], key=lambda c: c["index"]):
            ids = c["token_ids"]
            lps = c["logprobs"]["token_logprobs"] if c.get("logprobs") else []
            completions.append(
                Completion(
                    c.get("prompt_token_ids") or list(prompt_token_ids),
                    ids,
                    _floats(lps, len(ids)),
                    c["finish_reason"] or "stop",
                    c["text"],
                    c.get("routed_experts"),
                )
            )
        return completions

    async def chat(
        self,
        messages: list[dict],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> list[Completion]:
        """`n` samples answering `messages`, rendered with the model's chat template on the server."""
        payload: dict[str, Any] = {
            "messages": messages,
            **_sampling(n, max_tokens, temperature, top_p, stop, seed, stop_token_ids),
            "logprobs": True,
            "top_logprobs": 0,
        }
        if tools:
            payload["tools"] = tools
        if chat_template_kwargs:
            payload["chat_template_kwargs"] = chat_template_kwargs
        out = await self._balanced("/v1/chat/completions", payload, check=True)
        prompt_ids = out["prompt_token_ids"]
        completions = []
        for c in sorted(out["choices"], key=lambda c: c["index"]):
            ids = c["token_ids"]
            lps = [t["logprob"] for t in (c.get("logprobs") or {}).get("content") or []]
            completions.append(
                Completion(
                    list(prompt_ids),
                    ids,
                    _floats(lps, len(ids)),
                    c["finish_reason"] or "stop",
                    c["message"].get("content") or "",
                )
            )
        return completions

    async def score(self, token_ids: list[int]) -> list[float | None]:
        """log p(token_i | tokens_<i) for each token under the served model (temperature 1); first is None."""
        payload = {
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        }
        out = await self._balanced("/v1/completions", payload)
        entries = out["choices"][0]["prompt_logprobs"]
        scores: list[float | None] = []
        for tok, entry in zip(token_ids, entries, strict=True):
            scores.append(None if entry is None else float(entry[str(tok)]["logprob"]))
        return scores

    async def metrics_text(self) -> list[bytes | None]:
        """Each server's Prometheus `/metrics` page, undecoded, for load-based control: None for one that did not
        answer, is not the run's server (the same identity check as every request), or whose page is longer than
        `MAX_METRICS_BYTES` (read no further: a 100 MB page cost 86 s and 717 MB on the event loop). The caller
        decodes and parses off the loop (`primejax.orchestrator.concurrency.parse_pages`)."""

        async def one(url: str) -> bytes | None:
            try:
                await self._ensure_identity(url)
                async with self._http.stream("GET", url + "/metrics", timeout=5.0) as r:
                    if r.status_code != 200:
                        return None
                    chunks, size = [], 0
                    async for chunk in r.aiter_bytes():
                        size += len(chunk)
                        if size > MAX_METRICS_BYTES:
                            logger.warning(
                                "%s/metrics: longer than %d bytes; not read", url, MAX_METRICS_BYTES
                            )
                            return None
                        chunks.append(chunk)
                    return b"".join(chunks)
            except ServerIdentityError as e:
                logger.warning("%s/metrics: not read: %s", url, e)
                return None
            except (httpx.TransportError, httpx.TimeoutException):
                self._verified.discard(url)
                return None

        return list(await asyncio.gather(*(one(u) for u in self.base_urls)))


def _sampling(
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    stop: list[str] | None,
    seed: int | None,
    stop_token_ids: list[int] | None,
) -> dict[str, Any]:
    p: dict[str, Any] = {
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": -1,  # explicit: no model-dir default may narrow the sampling distribution
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if stop:
        p["stop"] = stop
        p["include_stop_str_in_output"] = True  # the text must match the token ids
    if stop_token_ids:
        p["stop_token_ids"] = stop_token_ids
    if seed is not None:
        p["seed"] = seed
    return p


def _floats(values: list, n: int) -> list[float]:
    if len(values) != n:
        raise InferenceError(f"server returned {len(values)} logprobs for {n} tokens")
    return [float(v) for v in values]
