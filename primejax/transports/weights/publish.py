"""The run's weight publisher, picked from `trainer.broadcast` (docs/weight_transfer.md, docs/lora.md).

`Publisher.publish(step, model)` (base.py) hands the model's weights for `step` to inference and returns the
step's metrics; each transport has its own (filesystem/, adapters/, collective/ publisher.py).
"""

from __future__ import annotations

from pathlib import Path

from primejax.models.config import ModelConfig
from primejax.transports.weights.adapters.publisher import AdapterPublisher, publishes_adapters
from primejax.transports.weights.base import Publisher
from primejax.transports.weights.collective.publisher import CollectivePublisher
from primejax.transports.weights.config import BroadcastConfig
from primejax.transports.weights.filesystem.publisher import FilesystemPublisher


def make_publisher(
    b: BroadcastConfig,
    root: str | Path,
    model_cfg: ModelConfig,
    *,
    async_level: int,
    max_steps: int,
    checkpoint_interval: int,
    num_receivers: int = 1,
    src_dir: str | None = None,
) -> Publisher:
    """The run's publisher from `trainer.broadcast` (`num_receivers`: inference workers, every server's; an
    adapter round goes to each server's API process, one per server)."""
    disk: FilesystemPublisher | AdapterPublisher
    if publishes_adapters(b, model_cfg):
        disk = AdapterPublisher(root, model_cfg, b, async_level=async_level, base_model=src_dir or "")
        num_receivers = max(1, num_receivers // b.workers_per_server)
    else:
        disk = FilesystemPublisher(root, model_cfg, b, async_level=async_level, src_dir=src_dir)
    if b.mode != "collective":
        return disk
    return CollectivePublisher(
        disk,
        num_receivers=num_receivers,
        checkpoint_interval=checkpoint_interval,
        last_sampled_step=max_steps - 1 - async_level,
    )


__all__ = [
    "Publisher",
    "FilesystemPublisher",
    "AdapterPublisher",
    "CollectivePublisher",
    "make_publisher",
    "publishes_adapters",
]
