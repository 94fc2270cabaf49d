"""Weight publishing: how θ_step reaches the inference servers, behind one interface.

`Publisher.publish(step, model)` hands the model's weights for `step` to inference and returns the step's
metrics. Three implementations (docs/weight_transfer.md, docs/lora.md):

- `FilesystemPublisher`: `broadcasts/step_N/` as HF safetensors + STABLE (contracts/broadcast.py), written
  through a temp directory. `trainer.broadcast.export = "parallel"` (default): every process writes the row
  blocks its devices hold into the shared files (transfer/fs_export.py); "gather": each tensor is gathered to
  the host and each process writes whole files (its share). With several processes process 0 publishes the
  directory once all have written.
- `AdapterPublisher` (LoRA with `trainer.broadcast.lora = "adapter"`): `broadcasts/step_N/` as a PEFT adapter
  directory (megabytes), which the server loads next to its frozen base under a versioned name
  (inference/adapters.py, docs/lora.md).
- `CollectivePublisher`: sends the weights through vLLM's weight-transfer engine (transfer/sender.py) and
  writes the disk copy only where one is needed: at checkpoint steps (a resumed run reloads from disk), for a
  step no one will sample from any more, when asked (`disk_only`, the re-export on resume) and as the fallback
  when a transfer fails. With several processes each sends its own row blocks over its own lane
  (transfer/lanes.py) and all agree on the round's outcome (any sender failed: all write the broadcast).
  With LoRA adapters (its disk publisher an `AdapterPublisher`) each round carries the adapter alone: PEFT's
  fp32 tensors and its config, over gloo from host memory to each server's API process, which assembles and
  loads it by version name (inference/adapter_transfer.py); several processes split the tensors between them.

Both prune the broadcasts inference can no longer be asked for (older than step - async_level).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from primejax.contracts.broadcast import prune_broadcasts, publish_broadcast, write_broadcast
from primejax.contracts.rundir import RunDir
from primejax.models.config import ModelConfig
from primejax.models.hf_io import export_safetensors, state_to_hf_tensors
from primejax.models.lora import split_adapters
from primejax.models.lora_io import adapter_tensors, peft_config, write_peft
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
            if self.b.export == "parallel":
                from primejax.transfer.fs_export import export_parallel

                return export_parallel(
                    model,
                    self.model_cfg,
                    d,
                    dtype=self.b.dtype,
                    src_dir=self.src_dir,
                    max_shard_bytes=int(self.b.max_shard_mb * 2**20),
                    threads=self.b.export_threads,
                )
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

    def gather(self, model: nnx.Module) -> dict:
        """The adapters of `model` whole on every process (every process joins the gather)."""
        adapters = split_adapters(nnx.to_pure_dict(nnx.state(model)))[0]
        if self.processes > 1:  # arrays other processes hold parts of
            adapters = multihost_utils.process_allgather(adapters, tiled=True)
        return adapters

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


class CollectivePublisher:
    """Sends each step through the weight-transfer engine; the disk copy only where needed (module docstring)."""

    def __init__(
        self,
        disk: FilesystemPublisher | AdapterPublisher,
        *,
        num_receivers: int,
        checkpoint_interval: int,
        last_sampled_step: int,
    ):
        """`last_sampled_step`: the newest policy the orchestrator will still sample from
        (max_steps - 1 - async_level); it stops listening after that, so a later send would wait out the
        whole transfer timeout for nobody."""
        self.disk, self.num_receivers = disk, num_receivers
        # LoRA: rounds carry the adapter alone, to each server's API process (num_receivers = servers).
        self.adapters = isinstance(disk, AdapterPublisher)
        self.checkpoint_interval, self.last_sampled_step = checkpoint_interval, last_sampled_step
        self._sender: Any = None
        # Several senders: whether the next round opens new groups (the first round, after any failure).
        self.new_group = True
        self.group_id = ""

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
            gpu = jax.default_backend() == "gpu" and not self.adapters  # adapters: gloo from host memory
            device = None
            if gpu:  # JAX's first local device, by its CUDA ordinal (one GPU of several visible)
                import torch

                device = torch.device("cuda", getattr(jax.local_devices()[0], "local_hardware_id", None) or 0)
            rank, senders = self.disk.rank, self.disk.processes
            kw = dict(
                secret=secret,
                host=b.transfer_host,
                timeout_s=b.transfer_timeout_s,
                bucket_bytes=b.bucket_mb * 2**20,
                num_receivers=self.num_receivers,
                backend="nccl" if gpu else "gloo",
                device=device,
                lane=rank,
                senders=senders,
                workers_per_server=1 if self.adapters else b.workers_per_server,
            )
            if senders == 1:
                self._sender = CollectiveSender(self.disk.run.root, port=b.transfer_port, **kw)
            else:  # process 0 hosts the rendezvous; the others learn its port
                port = b.transfer_port
                if rank == 0:
                    self._sender = CollectiveSender(self.disk.run.root, port=port, **kw)
                    port = self._sender.port
                port = int(multihost_utils.broadcast_one_to_all(np.int32(port)))
                if rank != 0:
                    self._sender = CollectiveSender(self.disk.run.root, port=port, **kw)
        return self._sender

    def _round_ids(self, step: int) -> tuple[str, str]:
        """(group id, round id), the same on every process: process 0's random bytes, broadcast."""
        raw = np.frombuffer(os.urandom(12), np.uint8) if self.disk.rank == 0 else np.zeros(12, np.uint8)
        raw = np.asarray(multihost_utils.broadcast_one_to_all(raw), np.uint8).tobytes().hex()
        if self.new_group:
            self.group_id, self.new_group = raw[:12], False
        return self.group_id, f"{step}-{raw[12:]}"

    def _send_sharded(self, step: int, model: nnx.Module) -> bool:
        """Every process sends its own row blocks (transfer/shards.py); True only when every sender succeeded."""
        from primejax.transfer.sender import to_torch
        from primejax.transfer.shards import RowShards

        sender = self.sender()
        shards = RowShards(model, self.disk.model_cfg, self.disk.b.dtype)
        ids = self._round_ids(step)
        tensors = (t if sender.backend == "nccl" else to_torch(t) for _, t in shards.local())
        ok = sender.send_lazy(step, shards.metas, tensors, pieces=shards.pieces(), ids=ids)
        agreed = bool(np.all(multihost_utils.process_allgather(np.array([ok]))))
        if not agreed:
            sender.group, self.new_group = None, True
        return agreed

    def _send_adapter(self, step: int, model: nnx.Module) -> bool:
        """One adapter round (PEFT's fp32 tensors + config); several processes send every P-th tensor each
        (whole tensors, over their lanes) and agree on the outcome. True only when every sender succeeded."""
        from primejax.inference.adapter_transfer import ADAPTER_KEY
        from primejax.transfer.lanes import Piece, rows
        from primejax.transfer.sender import tensor_metas, to_torch

        disk, sender = self.disk, self.sender()
        named = [(n, to_torch(a)) for n, a in adapter_tensors(disk.gather(model), disk.model_cfg).items()]
        extra = {ADAPTER_KEY: peft_config(disk.model_cfg, disk.base_model)}  # type: ignore[union-attr]
        if disk.processes == 1:
            return sender.send(step, named, extra=extra)
        metas, p = tensor_metas(named), disk.processes
        pieces = [Piece(i, i % p, 0, rows(m)) for i, m in enumerate(metas)]
        mine = (t for i, (_, t) in enumerate(named) if i % p == disk.rank)
        ok = sender.send_lazy(step, metas, mine, pieces=pieces, ids=self._round_ids(step), extra=extra)
        agreed = bool(np.all(multihost_utils.process_allgather(np.array([ok]))))
        if not agreed:
            sender.group, self.new_group = None, True
        return agreed

    def _after_send(self, step: int, model: nnx.Module, sent: bool, tensors: list | None = None) -> dict[str, float]:
        """A sent update also goes to disk on checkpoint steps (and a failed one always): the filesystem is
        what a restart or a lost server reads."""
        metrics = dict(self.sender().last) if sent else {"transfer/failed": 1.0}
        interval = self.checkpoint_interval
        if sent and not (interval > 0 and step % interval == 0):
            if self.disk.rank == 0:
                prune_broadcasts(self.disk.run.root, step - self.disk.async_level)
            return metrics
        extra = {} if tensors is None else {"tensors": tensors}  # the one-process path's gather, written as is
        return {**metrics, **self.disk.publish(step, model, **extra)}

    def publish(self, step: int, model: nnx.Module, *, disk_only: bool = False) -> dict[str, float]:
        if disk_only or step > self.last_sampled_step:
            return self.disk.publish(step, model)
        if self.adapters:
            return self._after_send(step, model, self._send_adapter(step, model))
        if self.disk.processes > 1:
            return self._after_send(step, model, self._send_sharded(step, model))
        from primejax.transfer.sender import to_torch

        sender, cfg, dtype = self.sender(), self.disk.model_cfg, self.disk.b.dtype
        tensors = None
        if sender.backend == "nccl":  # accelerator arrays straight into NCCL, no host copy
            from primejax.transfer.device import hf_device_tensors

            sent = sender.send_lazy(step, *hf_device_tensors(model, cfg, dtype))
        else:
            tensors = list(state_to_hf_tensors(model, cfg, dtype))  # the step's one gather
            sent = sender.send(step, [(n, to_torch(a)) for n, a in tensors])
        return self._after_send(step, model, sent, tensors)


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
