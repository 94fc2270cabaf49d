"""Weight publishing: how θ_step reaches the inference servers, behind one interface.

`Publisher.publish(step, model)` hands the model's weights for `step` to inference and returns the step's
metrics. Two implementations (docs/weight_transfer.md):

- `FilesystemPublisher`: `broadcasts/step_N/` as HF safetensors + STABLE (contracts/broadcast.py). One process
  writes it through a temp directory; with several processes each writes its share of the files into one
  shared temp directory (every process joins each tensor's gather) and process 0 publishes it once all have
  written.
- `AdapterPublisher` (LoRA with `trainer.broadcast.lora = "adapter"`): `broadcasts/step_N/` as a PEFT adapter
  directory (megabytes), which the server loads next to its frozen base under a versioned name
  (inference/adapters.py, docs/lora.md). The collective mode does not carry adapters: with LoRA it falls back
  to this publisher with one warning.
- `CollectivePublisher`: sends the weights through vLLM's weight-transfer engine (transfer/sender.py) and
  writes the disk copy only where one is needed: at checkpoint steps (a resumed run reloads from disk), for a
  step no one will sample from any more, when asked (`disk_only`, the re-export on resume) and as the fallback
  when a transfer fails. Single-process trainers only: a collective send would need every process to agree on
  its outcome.

Both prune the broadcasts inference can no longer be asked for (older than step - async_level).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import jax
from flax import nnx
from jax.experimental import multihost_utils

from primejax.contracts.broadcast import prune_broadcasts, publish_broadcast, write_broadcast
from primejax.contracts.rundir import RunDir
from primejax.models.config import ModelConfig
from primejax.models.hf_io import export_safetensors, state_to_hf_tensors
from primejax.models.lora import split_adapters
from primejax.models.lora_io import write_peft
from primejax.trainer.config import BroadcastConfig

log = logging.getLogger("primejax.trainer")


class Publisher(Protocol):
    def publish(self, step: int, model: nnx.Module, *, disk_only: bool = False) -> dict[str, float]:
        """Make θ_step (the parameters of `model`) available to inference; return the step's metrics."""
        ...


class FilesystemPublisher:
    """broadcasts/step_N on disk, written by one process or by every process its share (see module docstring)."""

    def __init__(
        self,
        root: str | Path,
        model_cfg: ModelConfig,
        b: BroadcastConfig,
        *,
        async_level: int,
        src_dir: str | None = None,
    ):
        self.run = RunDir(root)
        self.model_cfg, self.b, self.async_level, self.src_dir = model_cfg, b, async_level, src_dir
        self.rank, self.processes = jax.process_index(), jax.process_count()

    def publish(
        self, step: int, model: nnx.Module, *, disk_only: bool = False, tensors: list | None = None
    ) -> dict[str, float]:
        """Write broadcasts/step_<step>; `tensors`: the step's HF tensors when already gathered (the fallback
        after a failed collective send reuses its gather)."""
        start = time.perf_counter()

        def write(d: Path) -> dict:
            return export_safetensors(
                model,
                self.model_cfg,
                d,
                dtype=self.b.dtype,
                src_dir=self.src_dir,
                max_shard_bytes=int(self.b.max_shard_mb * 2**20),
                writer=(self.rank, self.processes),
                tensors=tensors,
            )

        if self.processes == 1:
            _, info = write_broadcast(self.run.root, step, write, hash_files=self.b.hash)
        else:
            info = self._write_shared(step, write)
            if info is None:
                return {}
        seconds = time.perf_counter() - start
        prune_broadcasts(self.run.root, step - self.async_level)
        return {
            "export/seconds": seconds,
            "export/gb": info["bytes"] / 1e9,
            "export/gb_per_s": info["bytes"] / 1e9 / max(seconds, 1e-9),
        }

    def _write_shared(self, step: int, write) -> dict | None:
        """Every process writes its share into one temp directory; process 0 publishes it (others get None)."""
        tmp = self.run.broadcast_export_tmp(step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        multihost_utils.sync_global_devices(f"primejax export dir {step}")
        info = write(tmp)
        log.info(
            "export step %d: process %d wrote %.3g of %.3g GB",
            step,
            self.rank,
            info["bytes_written"] / 1e9,
            info["bytes"] / 1e9,
        )
        multihost_utils.sync_global_devices(f"primejax export written {step}")
        if self.rank != 0:
            return None
        publish_broadcast(self.run.root, step, tmp, hash_files=self.b.hash)
        return info


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

    def publish(self, step: int, model: nnx.Module, *, disk_only: bool = False) -> dict[str, float]:
        """`model`: the model with its adapters apart (`Engine.lora_model()`); only the adapters are read."""
        start = time.perf_counter()
        adapters = split_adapters(nnx.to_pure_dict(nnx.state(model)))[0]
        if self.processes > 1:  # arrays other processes hold parts of: every process joins the gather
            adapters = multihost_utils.process_allgather(adapters, tiled=True)
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


class CollectivePublisher:
    """Sends each step through the weight-transfer engine; the disk copy only where needed (module docstring)."""

    def __init__(
        self,
        disk: FilesystemPublisher,
        *,
        num_receivers: int,
        checkpoint_interval: int,
        last_sampled_step: int,
    ):
        """`last_sampled_step`: the newest policy the orchestrator will still sample from
        (max_steps - 1 - async_level); it stops listening after that, so a later send would wait out the
        whole transfer timeout for nobody."""
        self.disk, self.num_receivers = disk, num_receivers
        self.checkpoint_interval, self.last_sampled_step = checkpoint_interval, last_sampled_step
        self._sender: Any = None

    def sender(self) -> Any:
        """The run's CollectiveSender: NCCL from the accelerator on GPU, else gloo from host memory."""
        if self._sender is None:
            from primejax.inference.admin_auth import read_token
            from primejax.transfer.sender import CollectiveSender

            b = self.disk.b
            secret = read_token(self.disk.run.root)
            if not secret:
                raise RuntimeError(
                    "collective weight transfer needs the run's admin secret ($PRIMEJAX_ADMIN_TOKEN or "
                    "<run>/admin_token, written by the launcher) to authenticate the servers"
                )
            gpu = jax.default_backend() == "gpu"
            device = None
            if gpu:  # JAX's first local device under the same CUDA_VISIBLE_DEVICES
                import torch

                device = torch.device("cuda", 0)
            self._sender = CollectiveSender(
                self.disk.run.root,
                secret=secret,
                host=b.transfer_host,
                port=b.transfer_port,
                timeout_s=b.transfer_timeout_s,
                bucket_bytes=b.bucket_mb * 2**20,
                num_receivers=self.num_receivers,
                backend="nccl" if gpu else "gloo",
                device=device,
            )
        return self._sender

    def publish(self, step: int, model: nnx.Module, *, disk_only: bool = False) -> dict[str, float]:
        if disk_only or step > self.last_sampled_step:
            return self.disk.publish(step, model)
        from primejax.transfer.sender import to_torch

        sender, cfg, dtype = self.sender(), self.disk.model_cfg, self.disk.b.dtype
        tensors = None
        if sender.backend == "nccl":  # accelerator arrays straight into NCCL, no host copy
            from primejax.transfer.device import hf_device_tensors

            sent = sender.send_lazy(step, *hf_device_tensors(model, cfg, dtype))
        else:
            tensors = list(state_to_hf_tensors(model, cfg, dtype))  # the step's one gather
            sent = sender.send(step, [(n, to_torch(a)) for n, a in tensors])
        metrics = dict(sender.last) if sent else {"transfer/failed": 1.0}
        interval = self.checkpoint_interval
        if sent and not (interval > 0 and step % interval == 0):
            prune_broadcasts(self.disk.run.root, step - self.disk.async_level)
            return metrics
        return {**metrics, **self.disk.publish(step, model, tensors=tensors)}


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
    """The run's publisher from `trainer.broadcast`: collective only for a single-process trainer; LoRA adapters
    always through the filesystem."""
    if publishes_adapters(b, model_cfg):
        if b.mode == "collective":
            log.warning(
                "trainer.broadcast.mode=collective does not carry LoRA adapters: each step's adapter goes "
                "through the filesystem (broadcasts/step_N, a PEFT directory of megabytes)"
            )
        return AdapterPublisher(root, model_cfg, b, async_level=async_level, base_model=src_dir or "")
    disk = FilesystemPublisher(root, model_cfg, b, async_level=async_level, src_dir=src_dir)
    if b.mode != "collective" or jax.process_count() > 1:
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
