"""The adapter transport's sender (LoRA with `trainer.broadcast.lora = "adapter"`): `broadcasts/step_N/` as a
PEFT adapter directory (megabytes), which the server loads next to its frozen base under a versioned name
(adapters/dirs.py, docs/lora.md). In collective mode the same adapter travels over the collective wire
(collective/publisher.py) to each server's API process (adapters/receiver.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.experimental import multihost_utils

from primejax.contracts.rundir import RunDir
from primejax.models.config import ModelConfig
from primejax.models.lora import split_adapters
from primejax.models.lora_io import adapter_tensors, peft_config, write_peft
from primejax.transports.weights.collective.meta import ADAPTER_KEY
from primejax.transports.weights.config import BroadcastConfig
from primejax.transports.weights.filesystem.broadcast import prune_broadcasts, write_broadcast


class AdapterPublisher:
    """LoRA: broadcasts/step_N as a PEFT adapter directory; process 0 writes it (the adapters are gathered
    whole first: they are small)."""

    def __init__(
        self,
        root: str | Path,
        model_cfg: ModelConfig,
        b: BroadcastConfig,
        *,
        async_level: int,
        base_model: str = "",
    ):
        self.run = RunDir(root)
        self.model_cfg, self.b, self.async_level, self.base_model = model_cfg, b, async_level, base_model
        self.rank, self.processes = jax.process_index(), jax.process_count()

    def gather(self, model: nnx.Module) -> dict:
        """The adapters of `model` whole on every process (every process joins the gather)."""
        adapters = split_adapters(nnx.to_pure_dict(nnx.state(model)))[0]
        if self.processes > 1:  # arrays other processes hold parts of
            adapters = multihost_utils.process_allgather(adapters, tiled=True)
        return adapters

    def adapter_round(self, model: nnx.Module) -> tuple[list[tuple[str, Any]], dict]:
        """A collective round of the adapter alone (collective/publisher.py): PEFT's fp32 lora_A / lora_B tensors by
        name, and the update info's extra key, the adapter's config, which marks the round as an adapter round."""
        tensors = list(adapter_tensors(self.gather(model), self.model_cfg).items())
        return tensors, {ADAPTER_KEY: peft_config(self.model_cfg, self.base_model)}

    def publish(self, step: int, model: nnx.Module, *, disk_only: bool = False) -> dict[str, float]:
        """`model`: the model with its adapters apart (`Engine.lora_model()`); only the adapters are read."""
        start = time.perf_counter()
        adapters = self.gather(model)
        if self.rank != 0:
            return {}
        _, nbytes = write_broadcast(
            self.run.root,
            step,
            lambda d: write_peft(adapters, self.model_cfg, d, base_model=self.base_model),
            hash_files=self.b.hash,
        )
        seconds = time.perf_counter() - start
        prune_broadcasts(self.run.root, step - self.async_level)
        return {
            "export/seconds": seconds,
            "export/gb": nbytes / 1e9,
            "export/gb_per_s": nbytes / 1e9 / max(seconds, 1e-9),
        }


def publishes_adapters(b: BroadcastConfig, model_cfg: ModelConfig) -> bool:
    """Whether the run's broadcasts are LoRA adapters (the trainer passes `Engine.lora_model()` to publish)."""
    return model_cfg.lora_rank > 0 and b.lora == "adapter"
