"""LoRA adapters received collectively: the server's side of an adapter round (docs/lora.md, docs/weight_transfer.md).

With `trainer.broadcast.mode = "collective"` and LoRA the trainer sends each step's adapter over the same wire
protocol as full weights (primejax.transports.weights.collective.wire: the same rendezvous store, digest, acknowledgement, lanes),
marked by the update info's `adapter` key, which holds the adapter's `adapter_config.json`. The tensors are the
PEFT directory's (names, fp32, [r, in] lora_A / [out, r] lora_B, models/lora_io.py).

Who receives: the API server process itself (one receiver per server, rank `rank_offset`; the trainer offers
`workers_per_server = 1` for adapter rounds), over gloo from host memory: vLLM loads adapters in its API process
by path (`OpenAIServingModels.load_lora_adapter`), and its workers read the adapter from that path whenever it
enters their LoRA cache, so a received adapter is assembled into a PEFT directory private to this process and
kept there until the adapter is unloaded. vLLM 0.31 has no in-memory route: `LoRARequest` carries a path (or a
tensorizer config, also a file), and `WorkerLoRAManager._load_adapter` always reads
`get_adapter_absolute_path(lora_path)` through `PEFTHelper.from_local_dir` and `LoRAModel.from_local_checkpoint`.

The checks are the filesystem route's (transports/weights/adapters/dirs.py: PEFT LoRA, rank within the server's, lora_A /
lora_B tensors only) plus the wire's (fp32 2-d tensors of the config's rank, gloo); a bad round is refused
before anything is received or loaded.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from primejax.transports.weights.adapters.dirs import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_adapter_config,
    check_adapter_names,
    check_lora_enabled,
)
from primejax.transports.weights.collective import lanes, meta, wire
from primejax.transports.weights.collective.meta import ADAPTER_KEY
from primejax.transports.weights.tensors import TensorMeta
from primejax.transports.weights.validate import WeightDirError


def is_adapter_round(update_info: object) -> bool:
    return isinstance(update_info, dict) and ADAPTER_KEY in update_info


def check_adapter_round(init_info: dict, update_info: dict, max_rank: int) -> list[TensorMeta]:
    """The round's tensor metadata, checked before anything is received (raises WeightDirError)."""
    check_lora_enabled("the collective update", max_rank)
    config = update_info.get(ADAPTER_KEY)
    check_adapter_config(config, max_rank, "update_info.adapter")
    if init_info.get("backend", "gloo") != "gloo":
        raise WeightDirError(
            f"init_info.backend: adapter rounds travel over gloo, not {init_info.get('backend')!r}"
        )
    if not isinstance(init_info.get("rank_offset"), int) or init_info["rank_offset"] < 1:
        raise WeightDirError("init_info.rank_offset (this server's rank, >= 1) is required")
    try:
        metas = meta.metas_from_update_info(update_info)
        lanes.pieces_of(update_info, metas)
    except (KeyError, TypeError, ValueError) as e:
        raise WeightDirError(f"update_info: {e}") from None
    names = [m.name for m in metas]
    check_adapter_names(names, "update_info.names")
    if len(set(names)) != len(names):
        raise WeightDirError("update_info.names: a tensor is named twice")
    rank = config["r"]
    for m in metas:
        r = m.shape[0] if ".lora_A." in m.name else m.shape[-1]
        if m.dtype != "float32" or len(m.shape) != 2 or r != rank:
            raise WeightDirError(
                f"update_info: {m.name}: {m.dtype} {list(m.shape)} is not an fp32 [r, in] lora_A / [out, r] "
                f"lora_B of rank {rank}"
            )
    return metas


def receive_adapter(
    receiver: wire.Receiver,
    init_info: dict,
    update_info: dict,
    secret: str | None,
    directory: Path,
    load: Callable[[Path], Any] | None = None,
) -> int:
    """Receive one adapter round (rank `init_info["rank_offset"]`), write it into `directory` as a PEFT adapter
    directory and call `load(directory)` (the server loads it into vLLM), all before acknowledging: the trainer
    counts a round as delivered only once the adapter is loaded. Returns the bytes received; raises (nothing
    acknowledged) on any failure."""
    from safetensors.numpy import save_file

    tensors: dict[str, Any] = {}

    def keep(pairs: list[tuple[str, Any]]) -> None:
        # Each bucket arrives in a fresh buffer (wire.receive_lanes): the views stay valid.
        tensors.update((name, t.numpy()) for name, t in pairs)

    def write_and_load() -> None:
        save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (directory / ADAPTER_CONFIG).write_text(json.dumps(update_info[ADAPTER_KEY], indent=2) + "\n")
        if load is not None:
            load(directory)

    rank = int(init_info["rank_offset"])
    return receiver.receive(init_info, update_info, rank, "cpu", keep, secret, before_ack=write_and_load)


class PrivateAdapterDirs:
    """The PEFT directories of the adapters this server received collectively, by served name: private to the
    process (mode 0700, in /dev/shm where it exists), each removed when its adapter is unloaded (and all at exit)."""

    def __init__(self, root: str | None = None):
        self.root = root or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
        self.dirs: dict[str, Path] = {}
        atexit.register(self.close)

    def create(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="primejax-adapter-", dir=self.root))

    def keep(self, name: str, directory: Path) -> None:
        old = self.dirs.get(name)
        if old is not None and old != directory:
            shutil.rmtree(old, ignore_errors=True)
        self.dirs[name] = directory

    def drop(self, name: str) -> None:
        directory = self.dirs.pop(name, None)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        for name in list(self.dirs):
            self.drop(name)


__all__ = ["ADAPTER_KEY", "PrivateAdapterDirs", "check_adapter_round", "is_adapter_round", "receive_adapter"]
