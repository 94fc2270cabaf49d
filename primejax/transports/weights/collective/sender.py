"""The trainer's side of a collective weight update (`trainer.broadcast.mode = "collective"`).

One `CollectiveSender` per trainer process 0 hosts the rendezvous store for the whole run (bound to `host` only;
every participant, this process included, answers a challenge on the run's secret: transports/weights/collective/rendezvous.py). `send(step, ...)`
runs one round: write the offer (primejax.transports.weights.collective.offer) -> (first round, or after a failure: wait for
every inference server to join the group) -> broadcast the HF tensors in packed buckets -> wait for every
server's acknowledgement (each server first checks what it received against the digest the sender publishes
after the last bucket) -> delete the offer.
Any failure or timeout returns False (the caller then writes the filesystem broadcast instead); nothing here
blocks longer than `timeout_s` per phase.

The tensors are the ones the safetensors export writes (HF names, layout and dtype; see
primejax.models.hf_io.state_to_hf_tensors), handed over as torch views of the same host memory on CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
import uuid
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from primejax.transports.weights.collective import meta, wire
from primejax.transports.weights.collective.offer import Offer, remove_offer, write_offer
from primejax.transports.weights.tensors import WIRE_DTYPES, TensorMeta

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


def tensor_metas(named: Sequence[tuple[str, Any]]) -> list[TensorMeta]:
    out = []
    for name, t in named:
        dtype = str(getattr(t, "dtype", "")).removeprefix("torch.")
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"{name}: dtype {dtype!r} cannot be sent (one of {WIRE_DTYPES})")
        out.append(TensorMeta(name, dtype, tuple(int(d) for d in t.shape)))
    return out


class CollectiveSender:
    """One trainer process's sender. Lane 0 (process 0, or the only process) hosts the rendezvous store and
    writes the offer; lane k > 0 (process k of a multi-process trainer) connects to lane 0's store at
    `port` and sends its own pieces over its own group (primejax.transports.weights.collective.lanes)."""

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
        lane: int = 0,
        senders: int = 1,
        workers_per_server: int = 1,
        stacks: bool = True,
        fused_experts: bool = True,
    ):
        """`stacks` / `fused_experts`: send runs of equal tensors as stacks (meta.py) / have the servers load an
        MoE layer's experts per projection (fused.py); both off is the per-tensor path before issue 47, kept
        for comparison (tools/bench_transfer.py --moe)."""
        self.run_dir = Path(run_dir)
        self.host, self.timeout_s, self.bucket_bytes = host, timeout_s, bucket_bytes
        self.num_receivers, self.backend, self.device = num_receivers, backend, device
        self.lane, self.senders, self.workers_per_server = lane, senders, workers_per_server
        self.stacks, self.fused_experts = stacks, fused_experts
        self.server = wire.host_store(host, port, secret) if lane == 0 else None
        self.port = self.server.port if self.server is not None else port
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
            "senders": self.senders,
            "workers_per_server": self.workers_per_server,
            "fused_experts": self.fused_experts,
        }

    def send(
        self, step: int, named: Sequence[tuple[str, Any]], *, extra: dict[str, Any] | None = None
    ) -> bool:
        """One round for `step` with `named` = [(HF name, torch tensor)]; True when every server acknowledged.
        `extra`: more update-info fields (a LoRA adapter round's `adapter` config, transports/weights/adapters/receiver.py)."""
        return self.send_lazy(step, tensor_metas(named), (t for _, t in named), extra=extra)

    def send_lazy(
        self,
        step: int,
        metas: Sequence[TensorMeta],
        tensors: Iterable[Any],
        *,
        pieces: Sequence[Any] | None = None,
        ids: tuple[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> bool:
        """Like `send`, with the tensors produced one by one (e.g. converted on device as they are sent).

        Several senders: `metas` are the round's tensors, `pieces` (primejax.transports.weights.collective.lanes.Piece) say who sends
        which rows, `tensors` are this lane's pieces in order, and `ids` = (group id, round id), the same on
        every sender (a new group id after any failed round)."""
        if ids is not None:
            if ids[0] != self.group_id:
                self.group = None
            self.group_id, round_id = ids
        else:
            round_id = f"{step}-{uuid.uuid4().hex[:12]}"
            if self.group is None:
                self.group_id = uuid.uuid4().hex[:12]
        # One sender: runs of equal tensors travel as stacks (meta.py, wire version 2); lanes send row blocks.
        stacks = meta.make_stacks(metas, self.bucket_bytes) if pieces is None and self.stacks else []
        info = {**meta.update_info(round_id, metas, stacks), **(extra or {})}
        if pieces is not None:
            info.update(senders=self.senders, pieces=[[p.tensor, p.sender, p.start, p.stop] for p in pieces])
        lane_metas = list(metas) if pieces is None else wire.lane_metas(metas, pieces, self.lane)
        t0 = time.perf_counter()
        if self.lane == 0:
            write_offer(self.run_dir, Offer(step, self.init_info(), info))
        try:
            if self.group is None:
                if self.store is None:
                    self.store = wire.client_store(self.host, self.port, self.secret, self.timeout_s)
                self.group = wire.open_group(
                    self.store,
                    wire.lane_group_id(self.group_id, self.lane),
                    0,
                    1 + self.num_receivers,
                    self.timeout_s,
                    self.backend,
                    self.device,
                )
            t_join = time.perf_counter()
            digest = wire.new_digest()
            try:
                nbytes = wire.send(
                    self.group, tensors, lane_metas, self.bucket_bytes, digest, self.device, stacks
                )
            except Exception as e:
                # The round was completed with zero buckets: tell the receivers now, not at their timeout.
                with contextlib.suppress(Exception):
                    self.store.set(
                        wire.lane_digest_key(round_id, self.lane),
                        f"{wire.ABORTED}: {type(e).__name__}: {str(e)[:200]}",
                    )
                raise
            self.store.set(wire.lane_digest_key(round_id, self.lane), digest.hexdigest())
            self.store.wait(
                [wire.ack_key(round_id, r) for r in range(1, 1 + self.num_receivers)],
                datetime.timedelta(seconds=self.timeout_s),
            )
        except Exception as e:  # noqa: BLE001 - any failure means: fall back to the filesystem for this step
            self.group = None
            log.warning(
                "step %d: collective weight transfer (sender %d of %d) failed after %.1f s (%s: %s); falling back "
                "to the filesystem broadcast",
                step,
                self.lane,
                self.senders,
                time.perf_counter() - t0,
                type(e).__name__,
                str(e)[:300],
            )
            return False
        finally:
            if self.lane == 0:
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
            "step %d: weights sent collectively (sender %d of %d: %.3f GB in %.3f s, join %.3f s)",
            step,
            self.lane,
            self.senders,
            nbytes / 1e9,
            t1 - t0,
            t_join - t0,
        )
        return True
