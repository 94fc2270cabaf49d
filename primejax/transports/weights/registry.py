"""The weight transports by name (`trainer.broadcast.mode`): a new transport is one folder (docs/weight_transfer.md).

A transport is a package `primejax/transports/weights/<name>/` whose `__init__.py` calls `register(Transport(...))`
with its publisher factory and, when its server side needs a route of its own, its routes. Nothing here scans
folders: `lookup(name)` imports exactly that package the first time the name is asked for (its import registers
it), and a transport registered by any module already imported (a plug-in, a test) is found as is.

Light on purpose (no JAX, no web framework): the config's validation of `mode` reads it, and the launcher and
`--help=keys` must not start a backend. A transport's factories import their heavy halves when called.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from primejax.transports.weights.base import Follower, Publisher, Server

PACKAGE = "primejax.transports.weights"
# The run's mode, in an inference server's environment (inference/server.py): its transport's routes are mounted.
TRANSPORT_ENV = "PRIMEJAX_WEIGHT_TRANSPORT"
NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")

# A route's answer: HTTP status and a JSON object.
Reply = tuple[int, dict[str, Any]]


@dataclass(frozen=True)
class Route:
    """A POST route the transport adds to every inference server: an admin route (the run's secret required,
    primejax/inference/admin_auth.py), whose body reaches `handler` as a JSON object. `handler(server, body)`
    drives the server's update protocol through `Server` (base.py) and returns the reply."""

    path: str
    handler: Callable[[Server, dict[str, Any]], Awaitable[Reply]]


@dataclass(frozen=True)
class Transport:
    """One weight transport: its name (the `trainer.broadcast.mode` value), the trainer's half (`publisher`,
    called once per run by `publish.make_publisher` with a `publish.PublishContext`: the section, the run's facts
    and its disk publisher), the server's routes beyond the built-in ones, and the orchestrator's half when the
    watcher must act for it each step (`follower`, called with the run directory; base.Follower)."""

    name: str
    publisher: Callable[[Any], Publisher]
    routes: tuple[Route, ...] = ()
    doc: str = ""
    follower: Callable[[Path], Follower] | None = None


_TRANSPORTS: dict[str, Transport] = {}


class UnknownTransport(ValueError):
    pass


def register(transport: Transport) -> Transport:
    """Add `transport` under its name; registering the same object again is a no-op, another one under a taken
    name is refused (two transports would silently shadow each other)."""
    if not NAME.fullmatch(transport.name):
        raise ValueError(f"transport name {transport.name!r}: lower-case letters, digits and _ (at most 40)")
    for route in transport.routes:
        if not route.path.startswith("/") or not callable(route.handler):
            raise ValueError(f"transport {transport.name}: route {route.path!r} needs a /path and a handler")
    held = _TRANSPORTS.get(transport.name)
    if held is not None and held is not transport:
        raise ValueError(f"a transport named {transport.name!r} is registered already")
    _TRANSPORTS[transport.name] = transport
    return transport


def unregister(name: str) -> None:
    """Drop a transport (tests that register a throwaway one)."""
    _TRANSPORTS.pop(name, None)


def lookup(name: str) -> Transport:
    """The transport `name`, importing `primejax.transports.weights.<name>` (its folder) if nothing registered
    it yet. Raises `UnknownTransport` with one line for any name that is no transport."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise UnknownTransport(f"{name!r} is not a transport name (lower-case letters, digits and _)")
    if name not in _TRANSPORTS:
        spec = importlib.util.find_spec(f"{PACKAGE}.{name}")
        if spec is not None and spec.submodule_search_locations is not None:  # a folder, not a helper module
            importlib.import_module(f"{PACKAGE}.{name}")
    if name not in _TRANSPORTS:
        raise UnknownTransport(
            f"no weight transport {name!r}: a transport is a folder primejax/transports/weights/<name>/ that "
            "registers itself, e.g. filesystem or collective (docs/weight_transfer.md)"
        )
    return _TRANSPORTS[name]


def follower_for(name: str, run_dir: str | Path) -> tuple[str, Follower] | None:
    """(name, the orchestrator's half) of transport `name` for the run in `run_dir`, or None when the watcher
    follows it by itself (broadcasts, collective offers)."""
    transport = lookup(name)
    return None if transport.follower is None else (transport.name, transport.follower(Path(run_dir)))


def registered() -> tuple[Transport, ...]:
    """The transports registered in this process so far, by name."""
    return tuple(_TRANSPORTS[n] for n in sorted(_TRANSPORTS))
