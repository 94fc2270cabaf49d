"""The routes of the registered weight transports on the inference server (transports/weights/registry.py).

A transport with a route of its own (`registry.Route`) gets it here without editing the server: `admin_router()`
is routes.py's admin routes plus every registered transport's, and each handler drives the update protocol
through `ServerSide`, the server's half of transports/weights/base.py's `Server`. Which transports a server has:
those its process imported, plus the run's `trainer.broadcast.mode` (`TRANSPORT_ENV`, set by `ServerSpec`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from primejax.inference.routes import (
    AdminState,
    _error,
    _json_body,
    _load_with,
    _state,
    _update_from_dir,
    router,
)
from primejax.transports.weights.registry import TRANSPORT_ENV, Reply, Route, lookup, registered

logger = logging.getLogger("primejax.inference")


class ServerSide:
    """transports/weights/base.py's `Server` over one server's `AdminState`: what a transport's route may do."""

    def __init__(self, state: AdminState):
        self._state = state

    @property
    def version(self) -> int:
        return self._state.version

    async def load_directory(self, weight_dir: str, version: int) -> Reply:
        if not isinstance(weight_dir, str) or not weight_dir:
            return HTTPStatus.BAD_REQUEST.value, {"error": "a weight directory (a path) is required"}
        return _reply(await _update_from_dir(self._state, weight_dir, version))

    async def load_with(self, version: int, transport: str, load: Callable[[Any], Awaitable[None]]) -> Reply:
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            return HTTPStatus.BAD_REQUEST.value, {"error": "'version' (int >= 0) is required"}
        async with self._state.lock:
            return _reply(await _load_with(self._state, version, transport, load))


def _reply(response: JSONResponse) -> Reply:
    return response.status_code, json.loads(response.body)


def _transport_endpoint(transport: str, route: Route) -> Callable[[Request], Awaitable[JSONResponse]]:
    async def endpoint(request: Request) -> JSONResponse:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            status, answer = await route.handler(ServerSide(_state(request)), body)
        except Exception as e:  # a transport's bug answers one line; the server keeps serving
            logger.exception("transport %s: %s failed", transport, route.path)
            return _error(
                HTTPStatus.INTERNAL_SERVER_ERROR, f"{route.path}: {type(e).__name__}: {str(e)[:300]}"
            )
        return JSONResponse(answer, status_code=status)

    return endpoint


def admin_router() -> APIRouter:
    """The admin routes above plus the routes of every weight transport registered now (all POST, so all
    admin: `admin_auth.protect` guards them as it guards these). A transport route may not take a path the
    server already serves."""
    if os.environ.get(TRANSPORT_ENV):
        lookup(os.environ[TRANSPORT_ENV])
    combined = APIRouter()
    combined.include_router(router)
    taken = {r.path for r in router.routes}
    for transport in registered():
        for route in transport.routes:
            if route.path in taken:
                raise ValueError(f"transport {transport.name}: route {route.path} is taken")
            taken.add(route.path)
            combined.add_api_route(route.path, _transport_endpoint(transport.name, route), methods=["POST"])
    return combined
