"""The collective transport's sender: each step through vLLM's weight-transfer engine (collective/sender.py),
the disk copy (its disk publisher's) only where one is needed: at checkpoint steps (a resumed run reloads from
disk), for a step no one will sample from any more, when asked (`disk_only`, the re-export on resume) and as the
fallback when a transfer fails. With several processes each sends its own row blocks over its own lane
(collective/lanes.py) and all agree on the round's outcome (any sender failed: all write the broadcast). With
LoRA adapters (its disk publisher an `AdapterPublisher`) each round carries the adapter alone: PEFT's fp32
tensors and its config, over gloo from host memory to each server's API process, which assembles and loads it by
version name (adapters/receiver.py); several processes split the tensors between them.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from primejax.contracts.secret import read_token
from primejax.models.hf_io import state_to_hf_tensors
from primejax.transports.weights.filesystem.broadcast import prune_broadcasts
from primejax.transports.weights.tensors import Piece, rows


class CollectivePublisher:
    """Sends each step through the weight-transfer engine; the disk copy only where needed (module docstring)."""

    def __init__(
        self,
        disk: Any,
        *,
        num_receivers: int,
        checkpoint_interval: int,
        last_sampled_step: int,
    ):
        """`disk`: the run's disk publisher, filesystem/ or adapters/ (whose `adapter_round` makes a round carry the
        adapter alone). `last_sampled_step`: the newest policy the orchestrator will still sample from
        (max_steps - 1 - async_level); it stops listening after that, so a later send would wait out the
        whole transfer timeout for nobody."""
        self.disk, self.num_receivers = disk, num_receivers
        # LoRA: rounds carry the adapter alone, to each server's API process (num_receivers = servers).
        self.adapters = hasattr(disk, "adapter_round")
        self.checkpoint_interval, self.last_sampled_step = checkpoint_interval, last_sampled_step
        self._sender: Any = None
        # Several senders: whether the next round opens new groups (the first round, after any failure).
        self.new_group = True
        self.group_id = ""

    def sender(self) -> Any:
        """The run's CollectiveSender: NCCL from the accelerator on GPU, else gloo from host memory."""
        if self._sender is None:
            from primejax.transports.weights.collective.sender import CollectiveSender

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
        """Every process sends its own row blocks (transports/weights/shards.py); True only when every sender succeeded."""
        from primejax.transports.weights.collective.sender import to_torch
        from primejax.transports.weights.shards import RowShards

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
        from primejax.transports.weights.collective.sender import tensor_metas, to_torch

        disk, sender = self.disk, self.sender()
        tensors, extra = disk.adapter_round(model)
        # Equal shapes next to each other (a stable sort: the same order on every process), so that one sender's
        # round carries them as stacks (meta.py): PEFT's order interleaves an expert's lora_A and lora_B. The
        # server keys the tensors by name, so the order is free.
        tensors = sorted(tensors, key=lambda na: (str(na[1].dtype), tuple(na[1].shape)))
        named = [(n, to_torch(a)) for n, a in tensors]
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

    def _after_send(
        self, step: int, model: nnx.Module, sent: bool, tensors: list | None = None
    ) -> dict[str, float]:
        """A sent update also goes to disk on checkpoint steps (and a failed one always): the filesystem is
        what a restart or a lost server reads."""
        metrics = dict(self.sender().last) if sent else {"transfer/failed": 1.0}
        interval = self.checkpoint_interval
        if sent and not (interval > 0 and step % interval == 0):
            if self.disk.rank == 0:
                prune_broadcasts(self.disk.run.root, step - self.disk.async_level)
            return metrics
        extra = (
            {} if tensors is None else {"tensors": tensors}
        )  # the one-process path's gather, written as is
        return {**metrics, **self.disk.publish(step, model, **extra)}

    def publish(self, step: int, model: nnx.Module, *, disk_only: bool = False) -> dict[str, float]:
        if disk_only or step > self.last_sampled_step:
            return self.disk.publish(step, model)
        if self.adapters:
            return self._after_send(step, model, self._send_adapter(step, model))
        if self.disk.processes > 1:
            return self._after_send(step, model, self._send_sharded(step, model))
        from primejax.transports.weights.collective.sender import to_torch

        sender, cfg, dtype = self.sender(), self.disk.model_cfg, self.disk.b.dtype
        tensors = None
        if sender.backend == "nccl":  # accelerator arrays straight into NCCL, no host copy
            from primejax.transports.weights.collective.device import hf_device_tensors

            sent = sender.send_lazy(step, *hf_device_tensors(model, cfg, dtype))
        else:
            tensors = list(state_to_hf_tensors(model, cfg, dtype))  # the step's one gather
            sent = sender.send(step, [(n, to_torch(a)) for n, a in tensors])
        return self._after_send(step, model, sent, tensors)
