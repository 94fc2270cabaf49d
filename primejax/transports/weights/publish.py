"""The run's weight publisher: `trainer.broadcast.mode`'s transport (registry.py) builds it (docs/weight_transfer.md,
docs/lora.md).

`Publisher.publish(step, model)` (base.py) hands the model's weights for `step` to inference and returns the
step's metrics; each transport has its own (filesystem/, collective/ publisher.py; adapters/ is the disk
publisher of a LoRA run, which every transport may wrap through `PublishContext.disk()`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from primejax.models.config import ModelConfig
from primejax.transports.weights.adapters.publisher import AdapterPublisher, publishes_adapters
from primejax.transports.weights.base import Publisher
from primejax.transports.weights.config import BroadcastConfig
from primejax.transports.weights.filesystem.publisher import FilesystemPublisher
from primejax.transports.weights.registry import lookup


@dataclass(frozen=True)
class PublishContext:
    """What a transport's publisher factory is given: the `trainer.broadcast` section and the run's facts."""

    broadcast: BroadcastConfig
    root: Path
    model_cfg: ModelConfig
    async_level: int
    max_steps: int
    checkpoint_interval: int
    num_receivers: int  # inference workers, every server's
    src_dir: str | None = None

    @property
    def adapters(self) -> bool:
        """The run publishes LoRA adapters alone (`trainer.broadcast.lora = "adapter"` with `model.lora`)."""
        return publishes_adapters(self.broadcast, self.model_cfg)

    def disk(self) -> FilesystemPublisher | AdapterPublisher:
        """The run's on-disk publisher: `broadcasts/step_N` as full HF weights, or as a PEFT adapter directory."""
        b = self.broadcast
        if self.adapters:
            return AdapterPublisher(
                self.root, self.model_cfg, b, async_level=self.async_level, base_model=self.src_dir or ""
            )
        return FilesystemPublisher(
            self.root, self.model_cfg, b, async_level=self.async_level, src_dir=self.src_dir
        )


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
    """The run's publisher: `trainer.broadcast.mode`'s transport's factory called with the run's facts."""
    ctx = PublishContext(
        b, Path(root), model_cfg, async_level, max_steps, checkpoint_interval, num_receivers, src_dir
    )
    return lookup(b.mode).publisher(ctx)


__all__ = [
    "Publisher",
    "PublishContext",
    "FilesystemPublisher",
    "AdapterPublisher",
    "make_publisher",
    "publishes_adapters",
]
