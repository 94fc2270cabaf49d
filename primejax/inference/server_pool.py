"""The run's inference servers as one pool: HTTP calls with retries, identity checks, servers down and back.

`ServerPool` is the base of `InferenceClient` (client.py: sampling) by way of `ServerAdmin` (server_admin.py:
admin calls); it holds what both need to reach a server at all.

Connection errors, timeouts and 5xx answers are retried with exponential backoff; 4xx answers are not (they
describe a bad request, which retrying does not fix) and raise `InferenceError` with the server's message.
A server whose request failed for good (unreachable, 5xx after retries) is marked down (`mark_down`, called by
the sampling and admin layers above): no request goes there until `revive()`, once the caller found it answering
again and put it back on the current weights (PolicyTracker.revive_replicas).

Every server's identity is checked before the first request to it and again after a connection to it failed
(a challenge on the run's admin secret, primejax.inference.identity): a URL answered by anything but the run's
own server raises `ServerIdentityError` in one line, and no sampling or admin request reaches it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Any, Self

import httpx

from primejax.inference import identity
from primejax.inference.admin_auth import HEADER, read_token
from primejax.inference.identity import ServerIdentityError

if TYPE_CHECKING:
    from primejax.inference.process import InferenceServerProcess

# One logger for the whole client (pool, admin calls, sampling): a level or filter set on it covers all its records.
logger = logging.getLogger("primejax.inference.client")


class InferenceError(RuntimeError):
    """A request the server rejected (4xx) or that kept failing after all retries."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerPool:
    """The servers at `base_urls`, reached through one HTTP client: retried calls, identity checks, `down`."""

    def __init__(
        self,
        base_urls: str | list[str] | tuple[str, ...],
        *,
        timeout_s: float,
        max_retries: int,
        backoff_s: float,
        max_backoff_s: float,
        transport: httpx.AsyncBaseTransport | None,
        admin_token: str | None,
        api_key: str | None,
    ):
        """The arguments are InferenceClient's (its docstring), which holds their defaults."""
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("InferenceClient needs at least one base URL")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.max_retries = max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        token = admin_token or read_token()
        self._admin_headers = {HEADER: token} if token else {}
        # Without a secret there is no identity to check (a server of one's own started by hand without one).
        self._secret = token
        self._verified: set[str] = set()
        self.down: set[str] = set()  # servers no request goes to until revive()
        # No connection cap: concurrency is the orchestrator's decision (its semaphore), not the pool's.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            transport=transport,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        )

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

    async def revive(self, url: str) -> None:
        """Route requests to `url` again (the caller checked it answers and serves the current weights)."""
        if url in self.down:
            self.down.discard(url)
            logger.warning("inference server %s is back", url)

    @property
    def up_urls(self) -> list[str]:
        return [u for u in self.base_urls if u not in self.down]

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
                last = InferenceError(
                    f"{method} {url}{path}: {r.status_code} {error_message(r)}", r.status_code
                )
                logger.warning("%s (attempt %d)", last, attempt + 1)
                continue
            if r.status_code >= 400:
                raise InferenceError(
                    f"{method} {url}{path}: {r.status_code} {error_message(r)}", r.status_code
                )
            return r.json() if r.content else None
        raise InferenceError(
            f"{method} {url}{path} failed after {self.max_retries + 1} attempts: {last}"
        ) from last

    async def _ensure_identity(self, url: str) -> None:
        if self._secret and url not in self._verified:
            await identity.verify(self._http, url, self._secret)
            self._verified.add(url)

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

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def error_message(r: httpx.Response) -> str:
    """The server's own words for a failed request (vLLM's `error`, FastAPI's `detail`), cut short."""
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
