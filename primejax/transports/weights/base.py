"""The two halves every weight transport has, one interface per direction (docs/weight_transfer.md).

- Trainer side, `Publisher.publish(step, model)`: make θ_step available to inference and return the step's
  metrics. One per transport: `filesystem.publisher.FilesystemPublisher`, `adapters.publisher.AdapterPublisher`,
  `collective.publisher.CollectivePublisher`; `publish.make_publisher` asks the registry (registry.py) for
  `trainer.broadcast.mode`'s transport and calls its publisher factory.
- Server side, `Receiver.receive(...)`: take one round of tensors and hand them to `load` (vLLM's
  `load_weights`, or an adapter assembler) before acknowledging. The filesystem transport has no receiver of
  its own (the server loads a checked directory, `validate.py`); `collective.wire.Receiver` is the collective
  one, which the vLLM engine (`collective.receiver`) and the adapter round (`adapters.receiver`) drive.
- Orchestrator side, `Follower` (optional): for a transport whose updates need the orchestrator to act each step
  (call one of its own routes on every server). The orchestrator's watcher (primejax/orchestrator/policy.py)
  follows broadcasts and collective offers by itself; a transport with a follower is asked too.
- Server side, `Server`: what a transport's own route (registry.Route) may do on an inference server: load a
  directory through the filesystem update's checks, or run a load of its own inside the update protocol. The
  server's routes (primejax/inference/routes.py) implement it.

A new transport is one folder beside these three that registers itself (registry.py, docs/weight_transfer.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from flax import nnx


class Publisher(Protocol):
    def publish(self, step: int, model: nnx.Module, *, disk_only: bool = False) -> dict[str, float]:
        """Make θ_step (the parameters of `model`) available to inference; return the step's metrics."""
        ...


class Receiver(Protocol):
    def receive(
        self,
        init_info: dict[str, Any],
        update_info: dict[str, Any],
        rank: int,
        device: Any,
        load: Callable[[list[tuple[str, Any]]], Any],
        secret: str | None,
        before_ack: Callable[[], Any] | None = None,
    ) -> int:
        """Receive one round as `rank`, handing whole tensors to `load`; `before_ack` runs after the last one
        and before the round is acknowledged. Returns the bytes received; raises when the round failed."""
        ...


class Follower(Protocol):
    """The orchestrator's half of a transport (registry.Transport.follower, built once per orchestrator with the
    run directory). The watcher asks it for the newest step it can deliver; when that is newer than what the
    servers serve and no older than the newest broadcast, it has it deliver that step. A failed delivery is not
    retried: the watcher loads that step's broadcast when the publisher wrote one (as the collective offer)."""

    async def newest(self) -> int | None:
        """The newest step this transport can deliver now (None: none)."""
        ...

    async def deliver(self, client: Any, step: int) -> None:
        """Make every server serve θ_step; `client` is the orchestrator's InferenceClient (its
        `post_admin(path, body)` reaches a route on every server). Raise when it failed."""
        ...


class Server(Protocol):
    """An inference server's update protocol, as a transport's route drives it. Each call takes the server's
    update lock and answers (HTTP status, JSON object): 200 with the served version on success, 4xx/5xx with one
    `error` line otherwise (a refused update touches nothing; a failed load restores the previous weights or
    marks the server unhealthy, as /update_weights does)."""

    @property
    def version(self) -> int:
        """The policy version served now."""
        ...

    async def load_directory(self, weight_dir: str, version: int) -> tuple[int, dict[str, Any]]:
        """Load an HF safetensors (or PEFT adapter) directory with /update_weights' checks (confined to the
        server's weights root, STABLE when required, headers against the served model) and protocol."""
        ...

    async def load_with(
        self, version: int, transport: str, load: Callable[[Any], Awaitable[None]]
    ) -> tuple[int, dict[str, Any]]:
        """Pause (in-flight requests kept) -> `await load(engine)` -> cache reset -> resume -> `version`, tagged
        `transport` in /weights_version. `engine` is the server's engine (its `load_weights(dir)`, ...)."""
        ...
