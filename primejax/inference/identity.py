"""Is the server at a URL this run's own? A challenge on the run's admin secret, checked per base URL.

A port that another program (or another run's server) took between the launcher's port check and the
server's bind answers `/liveness` like ours would; sampling from it trains on another model's samples, and
sending it weight updates changes another run. So before the first request to a URL (and again after a
connection to it failed, when a restart may have handed the port to someone else), the client asks
`GET /identity?nonce=<random>` and expects `HMAC-SHA256(secret, "primejax-identity:" + nonce)`. Only a
server started with the run's secret can answer; the secret itself never travels. A mismatch is one line
(`ServerIdentityError`) naming the URL and what answered.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import urllib.error
import urllib.request
from typing import Any

ROUTE = "/identity"


class ServerIdentityError(RuntimeError):
    """The server at a base URL is not this run's (one line, never retried)."""


def proof(secret: str, nonce: str) -> str:
    return hmac.new(secret.encode(), b"primejax-identity:" + nonce.encode(), hashlib.sha256).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(16)


def judge(url: str, secret: str, nonce: str, status: int, body: bytes) -> str | None:
    """Why the answer (`status`, `body`) to `GET url/identity?nonce=...` is not this run's server, or None."""
    where = f"the server at {url} is not this run's inference server"
    if status == 404:
        return f"{where}: it has no {ROUTE} route (another program holds the port?)"
    if status != 200:
        return f"{where}: {ROUTE} answered {status}"
    try:
        answer: Any = json.loads(body)
    except ValueError:
        return f"{where}: {ROUTE} answered something that is not JSON (another program holds the port?)"
    given = answer.get("proof") if isinstance(answer, dict) else None
    if not isinstance(given, str):
        return f"{where}: {ROUTE} answered without a proof (another program holds the port?)"
    if not hmac.compare_digest(given, proof(secret, nonce)):
        return f"{where}: it does not hold this run's admin secret (another run's server on the port?)"
    return None


async def verify(http: Any, url: str, secret: str, timeout_s: float = 30.0) -> None:
    """Raise ServerIdentityError unless the server at `url` answers the challenge (`http`: httpx.AsyncClient).
    Connection errors propagate as they are (the caller's retry policy decides)."""
    nonce = new_nonce()
    r = await http.get(f"{url}{ROUTE}", params={"nonce": nonce}, timeout=timeout_s)
    why = judge(url, secret, nonce, r.status_code, r.content)
    if why:
        raise ServerIdentityError(why)


def verify_sync(url: str, secret: str, timeout_s: float = 5.0) -> str | None:
    """Blocking form for the launcher's watch: why the server at `url` is not the run's; None if it is, or if it
    cannot be reached now (OSError: not up yet, or down, which the caller's liveness poll judges)."""
    nonce = new_nonce()
    try:
        with urllib.request.urlopen(f"{url}{ROUTE}?nonce={nonce}", timeout=timeout_s) as r:
            status, body = r.status, r.read(65536)
    except urllib.error.HTTPError as e:
        status, body = e.code, b""
    except OSError:
        return None
    return judge(url, secret, nonce, status, body)
