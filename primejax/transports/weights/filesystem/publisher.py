"""The filesystem transport's sender: `broadcasts/step_N/` as HF safetensors + STABLE (filesystem/broadcast.py),
written through a temp directory. `trainer.broadcast.export = "parallel"` (default): every process writes the
row blocks its devices hold into the shared files (filesystem/export.py); "gather": each tensor is gathered to
the host and each process writes whole files (its share). With several processes process 0 publishes the
directory once all have written. It prunes the broadcasts inference can no longer be asked for (older than
step - async_level).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import jax
from flax import nnx
from jax.experimental import multihost_utils

from primejax.contracts.rundir import RunDir
from primejax.models.config import ModelConfig
from primejax.models.hf_io import export_safetensors
from primejax.transports.weights.config import BroadcastConfig
from primejax.transports.weights.filesystem.broadcast import (
    prune_broadcasts,
    publish_broadcast,
    write_broadcast,
)

log = logging.getLogger("primejax.trainer")


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
                from primejax.transports.weights.filesystem.export import export_parallel

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
