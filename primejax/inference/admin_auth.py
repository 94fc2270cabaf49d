"""Who may change what the inference server serves: a shared secret on every admin (POST) route of primejax's
router, and weight loads confined to one directory tree.

The secret is generated per run by the launcher (`<run>/admin_token`, mode 0600) and reaches the server and the
orchestrator through the environment (`PRIMEJAX_ADMIN_TOKEN`; set it yourself on every host of a multi-node
run); it is never written to a config or a log. Requests carry it in the `X-Primejax-Admin-Token` header (not
`Authorization`, which vLLM's own `--api-key` uses for the OpenAI routes). A server started without one makes
up a secret nobody knows: its admin routes then answer 401 to everyone.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from primejax.contracts.rundir import RunDir
from primejax.contracts.secret import TOKEN_ENV, read_token  # the secret lives in contracts/secret.py

WEIGHTS_ROOT_ENV = "PRIMEJAX_WEIGHTS_ROOT"  # loads must resolve inside this directory ('' = anywhere)
REQUIRE_STABLE_ENV = "PRIMEJAX_REQUIRE_STABLE"  # "1": only broadcasts with a STABLE manifest load
HEADER = "X-Primejax-Admin-Token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_run_token(root: str | Path) -> str:
    """The run's admin secret: $PRIMEJAX_ADMIN_TOKEN when set (multi-node), else a new one; written to
    `<root>/admin_token` (0600) for processes started by hand on this host."""
    token = os.environ.get(TOKEN_ENV) or new_token()
    path = RunDir(root).admin_token
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)
    return token


def server_token(root: str | Path) -> str:
    """The secret of a server started by hand for run `root` (`python -m primejax.inference`):
    $PRIMEJAX_ADMIN_TOKEN, else the run's `<root>/admin_token`, else a new one written there (0600), so an
    orchestrator started by hand for the same run on this host finds it."""
    return read_token(root) or write_run_token(root)


def process_token() -> str:
    """This process's secret for servers it starts itself (tests, eval): $PRIMEJAX_ADMIN_TOKEN, set once here
    so that clients made later in this process send it."""
    if not os.environ.get(TOKEN_ENV):
        os.environ[TOKEN_ENV] = new_token()
    return os.environ[TOKEN_ENV]


def authorized(expected: str | None, given: str | None) -> bool:
    if expected is None:  # an AdminState built without a secret (in-process tests of the routes)
        return True
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


def protect(app: Any, router: Any) -> None:
    """Require the admin secret on every POST route of `router` served by `app` (401 otherwise).

    The check asks the app's own router which route a request reaches (Starlette's `route.matches`, the same
    test the routing does), never compares URL strings: under vLLM's `--root-path` the URL carries a prefix
    the route paths lack, and a string comparison let every admin call through without the secret."""
    from fastapi.responses import JSONResponse
    from starlette.routing import Match

    admin_endpoints = {r.endpoint for r in router.routes if "POST" in getattr(r, "methods", ())}

    def reaches_admin_route(scope: Any) -> bool:
        for route in app.router.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return getattr(route, "endpoint", None) in admin_endpoints
        return False

    @app.middleware("http")
    async def _require_admin(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        if reaches_admin_route(request.scope):
            state = getattr(request.app.state, "primejax", None)
            expected = getattr(state, "admin_token", None) if state is not None else new_token()
            if not authorized(expected, request.headers.get(HEADER)):
                return JSONResponse(
                    {"error": f"admin route: missing or wrong {HEADER} header"}, status_code=401
                )
        return await call_next(request)


def confine(weight_dir: str, root: str | None) -> str | None:
    """Why `weight_dir` may not be loaded (relative, or outside `root` once symlinks are resolved), or None."""
    if not os.path.isabs(weight_dir):
        return f"weight_dir must be an absolute path (got {weight_dir!r}): the server does not share the caller's cwd"
    if root:
        real, real_root = os.path.realpath(weight_dir), os.path.realpath(root)
        if os.path.commonpath([real, real_root]) != real_root:
            return f"weight_dir is outside the directory this server loads from ({root})"
    return None
