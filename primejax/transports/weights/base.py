"""The two halves every weight transport has, one interface per direction (docs/weight_transfer.md).

- Trainer side, `Publisher.publish(step, model)`: make θ_step available to inference and return the step's
  metrics. One per transport: `filesystem.publisher.FilesystemPublisher`, `adapters.publisher.AdapterPublisher`,
  `collective.publisher.CollectivePublisher`; `publish.make_publisher` picks the run's from `trainer.broadcast`.
- Server side, `Receiver.receive(...)`: take one round of tensors and hand them to `load` (vLLM's
  `load_weights`, or an adapter assembler) before acknowledging. The filesystem transport has no receiver of
  its own (the server loads a checked directory, `validate.py`); `collective.wire.Receiver` is the collective
  one, which the vLLM engine (`collective.receiver`) and the adapter round (`adapters.receiver`) drive.

A new transport is one folder beside these three, with its publisher, its receiver and its wire.
"""

from __future__ import annotations

from collections.abc import Callable
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
