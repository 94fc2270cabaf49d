"""The trainer's side of a collective weight update (`trainer.broadcast.mode = "collective"`).

One `CollectiveSender` per trainer process 0 hosts the rendezvous store for the whole run (bound to `host` only;
every participant, this process included, answers a challenge on the run's secret: transfer/rendezvous.py). `send(step, ...)`
runs one round: write the offer (primejax.contracts.transfer) -> (first round, or after a failure: wait for
every inference server to join the group) -> broadcast the HF tensors in packed buckets -> wait for every
server's acknowledgement (each server first checks what it received against the digest the sender publishes
after the last bucket) -> delete the offer.
Any failure or timeout returns False (the caller then writes the filesystem broadcast instead); nothing here
blocks longer than `timeout_s` per phase.

The tensors are the ones the safetensors export writes (HF names, layout and dtype; see
primejax.models.hf_io.state_to_hf_tensors), handed over as torch views of the same host memory on CPU.
"""

from __future__ import annotations

import datetime
import logging
import time
import uuid
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from primejax.contracts.transfer import Offer, remove_offer, write_offer
from primejax.transfer import wire

log = logging.getLogger("primejax.transfer")


def to_torch(array: np.ndarray) -> Any:
    """A torch view of a host array (bf16 via its uint16 bits: torch.from_numpy has no bfloat16)."""
    import torch

    array = np.ascontiguousarray(array)
    with warnings.catch_warnings():  # read-only host arrays (device_get): the sender never writes to them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(array)


def tensor_metas(named: Sequence[tuple[str, Any]]) -> list[wire.TensorMeta]:
    out = []
    for name, t in named:
        dtype = str(getattr(t, "dtype", "")).removeprefix("torch.")
        if dtype not in wire.WIRE_DTYPES:
            raise ValueError(f"{name}: dtype {dtype!r} cannot be sent (one of {wire.WIRE_DTYPES})")
        out.append(wire.TensorMeta(name, dtype, tuple(int(d) for d in t.shape)))
    return out


class CollectiveSender:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        secret: str,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 60.0,
        bucket_bytes: int = wire.DEFAULT_BUCKET_BYTES,
        num_receivers: int = 1,
        backend: str = "gloo",
        device: Any = None,
    ):
        self.run_dir = Path(run_dir)
        self.host, self.timeout_s, self.bucket_bytes = host, timeout_s, bucket_bytes
        self.num_receivers, self.backend, self.device = num_receivers, backend, device
        self.server = wire.host_store(host, port, secret)
        self.port = self.server.port
        self.secret = secret
        self.store: Any = None  # this process's own authenticated client of the server
        self.last: dict[str, float] = {}
        self.group: wire.TorchGroup | None = None
        self.group_id = ""

    def init_info(self) -> dict[str, Any]:
        return {
            "master_address": self.host,
            "master_port": self.port,
            "group_id": self.group_id,
            "world_size": 1 + self.num_receivers,
            "timeout_s": self.timeout_s,
            "bucket_bytes": self.bucket_bytes,
            "backend": self.backend,
        }

    def send(self, step: int, named: Sequence[tuple[str, Any]]) -> bool:
        """One round for `step` with `named` = [(HF name, torch tensor)]; True when every server acknowledged."""
        return self.send_lazy(step, tensor_metas(named), (t for _, t in named))

    def send_lazy(self, step: int, metas: Sequence[wire.TensorMeta], tensors: Iterable[Any]) -> bool:
        """Like `send`, with the tensors produced one by one (e.g. converted on device as they are sent)."""
        round_id = f"{step}-{uuid.uuid4().hex[:12]}"
        if self.group is None:
            self.group_id = uuid.uuid4().hex[:12]
        offer = Offer(step, self.init_info(), wire.update_info(round_id, metas))
        t0 = time.perf_counter()
        write_offer(self.run_dir, offer)
        try:
            if self.group is None:
                if self.store is None:
                    self.store = wire.client_store(self.host, self.port, self.secret, self.timeout_s)
                self.group = wire.open_group(
                    self.store,
                    self.group_id,
                    0,
                    1 + self.num_receivers,
                    self.timeout_s,
                    self.backend,
                    self.device,
                )
            t_join = time.perf_counter()
            digest = wire.new_digest()
            nbytes = wire.send(self.group, tensors, metas, self.bucket_bytes, digest)
            self.group.store.set(wire.digest_key(round_id), digest.hexdigest())
            self.group.store.wait(
                [wire.ack_key(round_id, r) for r in range(1, 1 + self.num_receivers)],
                datetime.timedelta(seconds=self.timeout_s),
            )
        except Exception as e:  # noqa: BLE001 - any failure means: fall back to the filesystem for this step
            self.group = None
            log.warning(
                "step %d: collective weight transfer failed after %.1f s (%s: %s); falling back to the "
                "filesystem broadcast",
                step,
                time.perf_counter() - t0,
                type(e).__name__,
                str(e)[:300],
            )
            return False
        finally:
            remove_offer(self.run_dir, step)
        t1 = time.perf_counter()
        self.last = {
            "transfer/seconds": t1 - t0,
            "transfer/join_seconds": t_join - t0,
            "transfer/send_seconds": t1 - t_join,
            "transfer/gb": nbytes / 1e9,
            "transfer/gb_per_s": nbytes / 1e9 / max(t1 - t_join, 1e-9),
        }
        log.info(
            "step %d: weights sent collectively (%.3f GB in %.3f s, join %.3f s)",
            step,
            nbytes / 1e9,
            t1 - t0,
            t_join - t0,
        )
        return True
