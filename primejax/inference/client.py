"""Async client for one or more primejax inference servers (vLLM + primejax admin routes).

Token-level throughout: prompts go in as token ids and every sample comes back with its exact prompt ids,
completion ids and the sampling logprob of each completion token, taken after temperature (the server
runs with `--logprobs-mode processed_logprobs`), which is what the trainer's importance ratio needs.

Generation requests are spread over the servers (least in-flight first), and the turns of one rollout stay on
the server its first request went to (its prompt prefix is cached there): the orchestrator opens a route per
group with `sticky_route()`, and every request made in that context (its tasks inherit it) follows it. Admin
calls go to every server that is up. A server whose request failed for good (unreachable, 5xx after retries)
is marked down: no request goes there until `revive()` finds it answering again and the caller has put it
back on the current weights (PolicyTracker.revive_replicas).
Connection errors, timeouts and 5xx answers are retried with exponential backoff; 4xx answers are not
(they describe a bad request, which retrying does not fix) and raise `InferenceError` with the server's
message.

Every server's identity is checked before the first request to it and again after a connection to it failed
(a challenge on the run's admin secret, primejax.inference.identity): a URL answered by anything but the run's
own server raises `ServerIdentityError` in one line, and no sampling or admin request reaches it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from primejax.inference import identity
from primejax.inference.admin_auth import HEADER, read_token
from primejax.inference.busy import BusyMeter
from primejax.inference.identity import ServerIdentityError
from primejax.inference.routed_experts import request_fields as routed_request_fields

if TYPE_CHECKING:
    from primejax.inference.process import InferenceServerProcess

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


class InferenceError(RuntimeError):
    """A request the server rejected (4xx) or that kept failing after all retries."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


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


class InferenceClient:
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
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("InferenceClient needs at least one base URL")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.api_key_var = api_key_var
        if api_key is None and api_key_var:
            api_key = os.environ.get(api_key_var) or None
        self.max_retries = max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._model = model
        # The LoRA adapter every server serves the current policy as (transports/weights/adapters/dirs.py): requests name it as
        # their `model`; "" = the served model itself. Learned from the servers' answers to weight updates.
        self._adapter = ""
        self.vocab_size = vocab_size
        token = admin_token or read_token()
        self._admin_headers = {HEADER: token} if token else {}
        # Without a secret there is no identity to check (a server of one's own started by hand without one).
        self._secret = token
        self._verified: set[str] = set()
        self.busy = BusyMeter(self.base_urls)  # requests outstanding per server, and their busy time
        self.down: set[str] = set()  # servers no request goes to until revive()
        self.last_load_seconds: dict[str, float] = {}  # each server's own load time of the last weight update
        # No connection cap: concurrency is the orchestrator's decision (its semaphore), not the pool's.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            transport=transport,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        )

    async def openai_endpoint(self) -> tuple[str, str]:
        """(server root URL, served model name) of the least-loaded server, for an environment that samples
        through a client of its own (verifiers' own rollout loop)."""
        url = self._pick()
        return url, await self._model_name(url)

    # ---------------------------------------------------------------- transport
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

    def mark_down(self, url: str, reason: str) -> None:
        if url not in self.down and len(self.base_urls) > 1:  # one server: nothing to route around
            logger.warning("inference server %s is down (%s): routing around it", url, reason)
            self.down.add(url)

    async def alive(self, url: str) -> bool:
        try:
            r = await self._http.get(url + "/liveness", timeout=5.0)
        except (httpx.TransportError, httpx.TimeoutException):
            return False
        return r.status_code == 200

    async def server_version(self, url: str) -> int:
        return int(
            (await self._request("GET", url, "/weights_version", None, self._admin_headers))["version"]
        )

    async def revive(self, url: str) -> None:
        """Route requests to `url` again (the caller checked it answers and serves the current weights)."""
        if url in self.down:
            self.down.discard(url)
            logger.warning("inference server %s is back", url)

    async def _request(
        self,
        method: str,
        url: str,
        path: str,
        payload: dict | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One HTTP call with retries on connection errors, timeouts and 5xx. Returns the decoded JSON."""
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
            try:
                await self._ensure_identity(url)
                r = await self._http.request(method, url + path, json=payload, headers=headers)
            except (httpx.TransportError, httpx.TimeoutException) as e:
                self._verified.discard(url)  # whoever answers next on this address is checked again
                last = e
                logger.warning("%s %s%s: %s (attempt %d)", method, url, path, type(e).__name__, attempt + 1)
                continue
            if r.status_code >= 500:
                last = InferenceError(f"{method} {url}{path}: {r.status_code} {_message(r)}", r.status_code)
                logger.warning("%s (attempt %d)", last, attempt + 1)
                continue
            if r.status_code >= 400:
                raise InferenceError(f"{method} {url}{path}: {r.status_code} {_message(r)}", r.status_code)
            return r.json() if r.content else None
        raise InferenceError(
            f"{method} {url}{path} failed after {self.max_retries + 1} attempts: {last}"
        ) from last

    async def _ensure_identity(self, url: str) -> None:
        if self._secret and url not in self._verified:
            await identity.verify(self._http, url, self._secret)
            self._verified.add(url)

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

    async def _all(self, method: str, path: str, payload: dict | None = None) -> list[Any]:
        # Admin calls (and only these) carry the secret: generation may go to endpoints that are not ours.
        async def one(url: str) -> Any:
            try:
                return await self._request(method, url, path, payload, self._admin_headers)
            except InferenceError as e:
                if e.status is None or e.status >= 500:
                    self.mark_down(url, str(e)[:200])
                raise

        return list(await asyncio.gather(*(one(u) for u in self.up_urls)))

    @property
    def up_urls(self) -> list[str]:
        return [u for u in self.base_urls if u not in self.down]

    async def update_one(self, url: str, weight_dir: str | None, version: int) -> None:
        """Put one server on `weight_dir` as `version` (None: back to the base model, version 0)."""
        if weight_dir is None:
            await self._request("POST", url, "/reload_weights", None, self._admin_headers)
        else:
            await self._request(
                "POST",
                url,
                "/update_weights",
                {"weight_dir": os.path.abspath(weight_dir), "version": int(version)},
                self._admin_headers,
            )

    def _note_loads(self, urls: list[str], answers: list[Any]) -> None:
        """Each server's own time to load the last update (`load_seconds` of its answer), for the run's metrics;
        an answer without a sane figure gives none."""
        loads = {}
        for url, a in zip(urls, answers, strict=False):
            s = a.get("load_seconds") if isinstance(a, dict) else None
            if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 0:
                loads[url] = float(s)
        self.last_load_seconds = loads

    def _adopt(self, answers: list[Any]) -> None:
        """Follow the servers to the adapter they all serve now (answers of /update_weights & co.)."""
        names = {a.get("adapter") or "" for a in answers if isinstance(a, dict)}
        if len(names) == 1:
            self._adapter = names.pop()

    @property
    def adapter(self) -> str:
        """The LoRA adapter requests are sent to ("" = the served model itself)."""
        return self._adapter

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

    # ---------------------------------------------------------------- admin
    async def update_weights(self, weight_dir: str, version: int) -> None:
        """Load `weight_dir` in place on every server and serve it as `version`."""
        # Absolute on the wire: a server on another host (or another cwd) must not resolve our relative path.
        await self.post_admin(
            "/update_weights", {"weight_dir": os.path.abspath(weight_dir), "version": int(version)}
        )

    async def transfer_weights(self, version: int, init_info: dict, update_info: dict) -> None:
        """Receive `version` collectively on every server (the trainer is sending); the workers of server i join
        as ranks 1 + i * workers_per_server + their own rank (a tensor-parallel server has several).

        Not retried: a round is one rendezvous with the trainer and cannot be joined twice.
        """

        async def one(i: int, url: str) -> Any:
            workers = int(init_info.get("workers_per_server", 1))
            body = {
                "version": int(version),
                "init_info": {**init_info, "rank_offset": 1 + i * workers},
                "update_info": update_info,
            }
            await self._ensure_identity(url)
            r = await self._http.post(
                url + "/transfer_weights",
                json=body,
                headers=self._admin_headers,
                timeout=float(init_info.get("timeout_s", 60.0)) + 120.0,
            )
            if r.status_code >= 400:
                raise InferenceError(
                    f"POST {url}/transfer_weights: {r.status_code} {_message(r)}", r.status_code
                )
            return r.json()

        urls = self.up_urls
        answers = list(await asyncio.gather(*(one(i, u) for i, u in enumerate(urls))))
        self._note_loads(urls, answers)
        self._adopt(answers)

    async def post_admin(self, path: str, body: dict) -> list[Any]:
        """POST `body` to an admin route on every server (a transport's own, registry.Route) and return the
        answers; an update's answers are read as /update_weights' are (load seconds, the adapter served)."""
        urls = self.up_urls
        answers = await self._all("POST", path, body)
        self._note_loads(urls, answers)
        self._adopt(answers)
        return answers

    async def reload_weights(self) -> None:
        """Go back to the base model on every server (version 0)."""
        self._adopt(await self._all("POST", "/reload_weights"))

    async def pause(self) -> None:
        await self._all("POST", "/pause")

    async def resume(self) -> None:
        await self._all("POST", "/resume")

    async def weights_version(self) -> int:
        """The weight version every server has reached (the minimum over servers); where they all serve one
        version, requests follow them to its adapter (an orchestrator restarted next to live servers)."""
        answers = await self._all("GET", "/weights_version")
        if len({int(v["version"]) for v in answers}) == 1:
            self._adopt(answers)
        return min(int(v["version"]) for v in answers)

    async def wait_ready(self, timeout_s: float, process: InferenceServerProcess | None = None) -> None:
        """Wait until every server answers GET /liveness. Raises at once if `process` died (with its log)."""
        deadline = time.monotonic() + timeout_s
        pending = set(self.base_urls)
        while pending:
            if process is not None:
                process.raise_if_dead()
            for url in list(pending):
                try:
                    r = await self._http.get(url + "/liveness", timeout=5.0)
                    if r.status_code == 200:
                        self._verified.discard(url)
                        await self._ensure_identity(url)  # ServerIdentityError: not the run's server
                        pending.discard(url)
                    elif r.status_code == 404:
                        raise ServerIdentityError(
                            f"the server at {url} is not this run's inference server: "
                            "it has no /liveness route (another program holds the port?)"
                        )
                except (httpx.TransportError, httpx.TimeoutException):
                    pass
            if pending:
                if time.monotonic() > deadline:
                    raise InferenceError(
                        f"inference servers not ready after {timeout_s:.0f} s: {sorted(pending)}"
                    )
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


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


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:1000]
    return str(body)[:1000]
