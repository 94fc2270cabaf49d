"""The collective weight-transfer wire protocol, shared by the trainer's sender and the vLLM-side engine.

One update ("round") moves every HF tensor of the model, in a fixed order both sides know beforehand (names,
dtypes and shapes travel over HTTP in the update info). The bytes travel as packed buckets: tensors are
flattened to uint8 and concatenated until a bucket holds MORE than `bucket_bytes` (the tensor that crosses
the bound still goes in), the same cut rule as vLLM's packed NCCL broadcast
(`vllm/distributed/weight_transfer/packed_tensor.py`), so both sides cut identical buckets from the metadata
alone; since wire version 2 the cut runs over units, a tensor or a stack of equal tensors that is never split
(meta.py). Each bucket is one `broadcast` from rank 0 (the trainer) to every inference worker.

Rendezvous: the trainer hosts a store for the whole run (primejax.transports.weights.collective.rendezvous: bound to the configured
host only, every participant answers a challenge on the run's secret). A process group (gloo on CPU, NCCL on
GPU) lives under the store prefix `group/<group_id>/` and serves round after round (creating an NCCL
communicator costs far more than moving a small model); after any failure both sides drop it and the next
round opens a new one under a new id, so a failed round leaves nothing behind. Every collective has a
timeout, so a dead or stalled peer turns into an exception on both sides, never a hang. After loading, each
receiver sets `received/<round_id>/<rank>` in the group's store; the trainer treats a round without every
acknowledgement as failed (and falls back to the filesystem). Integrity: the sender hashes every bucket as it
sends it and, after the last one, sets `digest/<round_id>` in the (authenticated) store; a receiver compares it
with its own hash of what arrived before it acknowledges, so a server whose bytes differ reports the round as
failed and its version does not move.

torch is imported inside the functions: the trainer's other code paths never need it.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from primejax.transports.weights.collective import lanes, meta
from primejax.transports.weights.collective.meta import metas_from_update_info
from primejax.transports.weights.tensors import TensorMeta, piece_bytes, rows

DEFAULT_BUCKET_BYTES = 256 * 2**20


class TorchGroup:
    """A torch.distributed process group object (gloo or NCCL) used without the global default group."""

    def __init__(self, pg: Any, rank: int, store: Any, base: Any = None):
        # `base` keeps the Python store object alive: torch's trampoline needs it for as long as `store` is used.
        self.pg, self.rank, self.store, self.base = pg, rank, store, base

    def broadcast(self, tensor: Any, src: int = 0) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([tensor], opts).wait()


def host_store(host: str, port: int, secret: str) -> Any:
    """The trainer's rendezvous server, bound to `host` only (port 0 = any free port; read `.port`)."""
    from primejax.transports.weights.collective.rendezvous import StoreServer

    return StoreServer(host, port, secret)


def client_store(host: str, port: int, secret: str, timeout_s: float) -> Any:
    """A participant's authenticated connection to the rendezvous (raises RendezvousAuthError for an impostor)."""
    from primejax.transports.weights.collective.rendezvous import connect_store

    return connect_store(host, port, secret, timeout_s)


# What a sender stores in place of its digest when it could not send the round (receivers fail at once).
ABORTED = "aborted"


def digest_key(round_id: str) -> str:
    return f"digest/{round_id}"


def _hash_bucket(h: Any, buf: Any) -> None:
    """Feed one bucket to `h`: its bytes on the host; on a GPU a fingerprint computed there (two int64 sums of
    its 16-bit words, plain and position-weighted, in chunks) so that verifying costs no host copy."""
    import torch

    if not buf.is_cuda:
        h.update(buf.numpy().data)
        return
    words = buf[: buf.numel() // 2 * 2].view(torch.int16)
    chunk = 1 << 24
    for start in range(0, words.numel(), chunk):
        w = words[start : start + chunk].to(torch.int64)
        pos = torch.arange(1, w.numel() + 1, device=w.device, dtype=torch.int64)
        h.update(torch.stack([w.sum(), (w * pos).sum()]).cpu().numpy().tobytes())
    h.update(buf[buf.numel() // 2 * 2 :].cpu().numpy().tobytes())


def new_digest() -> Any:
    return hashlib.blake2b(digest_size=32)


def open_group(
    store: Any,
    group_id: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    backend: str = "gloo",
    device: Any = None,
) -> TorchGroup:
    """Join group `group_id` (blocks until all `world_size` ranks joined, at most `timeout_s`)."""
    import torch
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"group/{group_id}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        with _nccl_errors_raise():
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        # NCCL communicators are created lazily on the first collective: warm up so the join is inside open.
        torch.cuda.set_device(device)
        warm = torch.zeros(1, device=device)
        pg.allreduce([warm]).wait()
        torch.cuda.synchronize(device)
    else:
        raise ValueError(f"unknown transfer backend {backend!r} (gloo | nccl)")
    return TorchGroup(pg, rank, prefixed, store)


# Read by ProcessGroupNCCL's constructor, so they apply to this group alone. Blocking wait: a collective whose
# peer died raises in the waiting thread at the timeout. Error handling 2 (clean up only): the failed group's
# communicators are aborted and the process lives; torch's default (3) ends the whole process, which for a vLLM
# worker is the inference server (seen on H200s: docs/gpu.md).
NCCL_GROUP_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


@contextlib.contextmanager
def _nccl_errors_raise() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in NCCL_GROUP_ENV}
    os.environ.update(NCCL_GROUP_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _as_bytes(tensor: Any) -> Any:
    return tensor.contiguous().view(-1).view(__import__("torch").uint8)


def _blocks(tensors: Iterable[Any], metas: Sequence[TensorMeta]) -> Iterator[tuple[int, int, Any]]:
    """(first tensor, count, its bytes) per item of `tensors`: an item is one tensor of its metadata's shape, or
    `count` consecutive tensors of one dtype and shape stacked on a new leading axis (a converted run of
    layers or experts, device.py). ValueError names the first tensor that disagrees with its metadata."""
    i = 0
    for t in tensors:
        if i >= len(metas):
            raise ValueError(f"more tensors than the round's {len(metas)}")
        m = metas[i]
        shape, dtype = tuple(t.shape), str(t.dtype).removeprefix("torch.")
        run = shape != m.shape and len(shape) == len(m.shape) + 1 and shape[1:] == m.shape
        n = shape[0] if run else 1
        if dtype != m.dtype or not (run or shape == m.shape) or n < 1 or i + n > len(metas):
            raise ValueError(f"tensor {m.name}: got {t.dtype} {shape}, declared {m.dtype} {m.shape}")
        for j in range(i + 1, i + n):
            if (metas[j].dtype, metas[j].shape) != (m.dtype, m.shape):
                raise ValueError(f"tensor {metas[j].name}: sent in a stack of {m.name}'s shape {m.shape}")
        yield i, n, _as_bytes(t)
        i += n


def send(
    group: TorchGroup,
    tensors: Iterable[Any],
    metas: Sequence[TensorMeta],
    bucket_bytes: int,
    digest: Any = None,
    device: Any = None,
    stacks: Sequence[tuple[int, int]] = (),
) -> int:
    """Rank 0: broadcast `tensors` (torch, matching `metas` in order, dtype and shape; an item may also be a run
    of consecutive tensors stacked, see `_blocks`) bucket by bucket, cut over the round's units (`stacks`,
    meta.py), feeding each bucket to `digest` (a hashlib object) when given. A bucket's bytes are a view of
    one item where they lie in one, else one concatenation of a few slices: no per-tensor work.

    Returns the bytes sent. Raises ValueError naming the first tensor that disagrees with its metadata (the
    receivers cut buckets from the metadata, so a mismatch would otherwise split the stream differently).
    When producing a bucket fails (a bad tensor, a conversion error), the round is still completed with zero
    buckets (on `device`, the group's) before the error is raised: receivers already wait in the broadcast, and
    an NCCL receiver left waiting is torn down with its whole process when the collective times out; completed,
    they reject the round by its digest (the caller marks it aborted) and stay up.
    """
    import torch

    units = meta.stacks_of({"stacks": [list(s) for s in stacks]}, metas)
    plan = meta.unit_buckets(metas, units, bucket_bytes)
    stream = _blocks(tensors, metas)
    cur: tuple[int, int, Any] | None = None
    sent = 0
    for b, idx in enumerate(plan):
        lo, hi = units[idx[0]][0], units[idx[-1]][0] + units[idx[-1]][1]  # the bucket's tensors [lo, hi)
        try:
            parts, at = [], lo
            while at < hi:
                if cur is None or cur[0] + cur[1] <= at:
                    cur = next(stream)
                first, n, raw = cur
                per = raw.numel() // n
                stop = min(hi, first + n)
                parts.append(raw[(at - first) * per : (stop - first) * per])
                at = stop
            buf = parts[0] if len(parts) == 1 else torch.cat(parts)
        except Exception as e:
            for rest in plan[b:]:
                size = sum(metas[units[u][0]].nbytes * units[u][1] for u in rest)
                group.broadcast(torch.zeros(size, dtype=torch.uint8, device=device))
            if isinstance(e, StopIteration):
                raise ValueError(f"fewer tensors than the round's {len(metas)}") from None
            raise
        group.broadcast(buf, src=0)
        if digest is not None:
            _hash_bucket(digest, buf)
        if buf.is_cuda:
            # The bucket's sources may be DLPack views of JAX buffers: once released here JAX may reuse their
            # memory on its own stream, so every queued read of them (cat, broadcast) must be done first.
            torch.cuda.current_stream(buf.device).synchronize()
        sent += buf.numel()
        del parts, buf
    return sent


def ack_key(round_id: str, rank: int) -> str:
    return f"received/{round_id}/{rank}"


def lane_group_id(group_id: str, lane: int) -> str:
    """The process group of sender `lane` (primejax.transports.weights.collective.lanes): one per sender, all in one store."""
    return f"{group_id}/{lane}"


def lane_digest_key(round_id: str, lane: int) -> str:
    return f"{digest_key(round_id)}/{lane}"


def receive_lanes(
    groups: Sequence[TorchGroup],
    metas: Sequence[TensorMeta],
    update_info: dict[str, Any],
    bucket_bytes: int,
    device: Any,
    load: Callable[[list[tuple[str, Any]]], Any],
    digests: Sequence[Any],
) -> int:
    """A receiver's round over every sender's lane (primejax.transports.weights.collective.lanes): each bucket into a fresh buffer,
    fed to its lane's digest; `load` gets the tensors that became whole, as the lanes' schedule completes them."""
    import torch

    if update_info.get("pieces") is None and int(update_info.get("senders", 1)) == len(groups) == 1:
        # One sender: whole tensors and stacks (the pieces' per-tensor bookkeeping is skipped: 30 ms for 30B-A3B)
        units = meta.stacks_of(update_info, metas)
        return receive_units(groups[0], metas, units, bucket_bytes, device, load, digests[0])
    senders, pieces = lanes.pieces_of(update_info, metas)
    if senders != len(groups):
        raise ValueError(f"round of {senders} senders received over {len(groups)} groups")
    per_lane = lanes.lane_buckets(metas, pieces, senders, bucket_bytes)
    assembler = lanes.Assembler(metas, device)
    received = 0
    for k, j in lanes.schedule(per_lane):
        idx = per_lane[k][j]
        sizes = [piece_bytes(metas[pieces[i].tensor], pieces[i]) for i in idx]
        buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        groups[k].broadcast(buf, src=0)
        _hash_bucket(digests[k], buf)
        done = [
            t for i, part in zip(idx, buf.split(sizes), strict=True) if (t := assembler.add(pieces[i], part))
        ]
        if done:
            load(done)
        received += buf.numel()
    assembler.check_done()
    return received


def receive_units(
    group: TorchGroup,
    metas: Sequence[TensorMeta],
    units: Sequence[tuple[int, int]],
    bucket_bytes: int,
    device: Any,
    load: Callable[[list[tuple[str, Any]]], Any],
    digest: Any,
) -> int:
    """A receiver's single-sender round: each bucket into a fresh buffer, fed to `digest`, its units viewed
    in place (no copy). A stack goes whole to `load.stacked(names, tensor[count, ...])` when the loader has
    one (an MoE layer's experts in one copy, fused.py), else as its tensors' views to `load`."""
    import torch

    stacked = getattr(load, "stacked", None)
    received = 0
    for idx in meta.unit_buckets(metas, units, bucket_bytes):
        sizes = [metas[units[u][0]].nbytes * units[u][1] for u in idx]
        buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        group.broadcast(buf, src=0)
        _hash_bucket(digest, buf)
        pairs: list[tuple[str, Any]] = []
        for u, part in zip(idx, buf.split(sizes), strict=True):
            a, n = units[u]
            m = metas[a]
            t = part.view(getattr(torch, m.dtype)).view(n, *m.shape)
            if n > 1 and stacked is not None:
                if pairs:  # the loader sees the tensors in the round's order
                    load(pairs)
                    pairs = []
                stacked([x.name for x in metas[a : a + n]], t)
            else:
                pairs += [(metas[a + j].name, x) for j, x in enumerate(t.unbind(0))]
        if pairs:
            load(pairs)
        received += buf.numel()
    return received


def lane_metas(metas: Sequence[TensorMeta], pieces: Sequence[Any], lane: int) -> list[TensorMeta]:
    """What sender `lane` sends, piece by piece, as tensor metadata (a row block's own shape), so `send` checks
    each block and cuts the lane's buckets exactly where the receivers do."""
    out = []
    for p in pieces:
        if p.sender == lane:
            m = metas[p.tensor]
            whole = p.stop - p.start == rows(m)
            out.append(m if whole else TensorMeta(m.name, m.dtype, (p.stop - p.start, *m.shape[1:])))
    return out


class Receiver:
    """An inference worker's side of the rounds: joins (and keeps) every sender's group, receives, acknowledges.

    Shared by primejax's vLLM engine (`primejax.inference.vllm_ext`) and the GPU benchmark's receiver, so the
    benchmark measures the code the server runs.
    """

    def __init__(self) -> None:
        self.groups: list[TorchGroup] | None = None
        self.key: tuple | None = None

    @property
    def group(self) -> TorchGroup | None:
        """Lane 0's group (the single-sender round's only one)."""
        return self.groups[0] if self.groups else None

    def receive(
        self,
        init_info: dict[str, Any],
        update_info: dict[str, Any],
        rank: int,
        device: Any,
        load: Callable[[list[tuple[str, Any]]], Any],
        secret: str | None,
        before_ack: Callable[[], Any] | None = None,
    ) -> int:
        """Receive one round; raises (and acknowledges nothing) when the rendezvous is not this run's (`secret`
        is the run's admin secret) or when what arrived differs from a sender's digest. `before_ack`: run once
        everything arrived and matched, before the acknowledgement (a LoRA adapter is loaded there, so an
        acknowledged round is a served one); if it raises, nothing is acknowledged."""
        metas = metas_from_update_info(update_info)  # refuses another wire version
        lanes.pieces_of(update_info, metas)  # and a manifest that lies, before joining anything
        timeout_s = float(init_info.get("timeout_s", 60.0))
        key = (
            init_info["master_address"],
            int(init_info["master_port"]),
            init_info["group_id"],
            rank,
            int(init_info["world_size"]),
            init_info.get("backend", "gloo"),
            int(init_info.get("senders", 1)),
        )
        if key[5] == "gloo":
            # gloo moves host tensors: receive into host memory (load_weights copies each tensor to a GPU worker's
            # device), where the digest is computed over the bytes as the sender's is (`_hash_bucket` hashes a CUDA
            # buffer another way). Into a GPU vLLM on an H200, every gloo round was refused as a digest mismatch.
            device = None
        try:
            if self.groups is None or self.key != key:
                self.groups = None
                store = client_store(key[0], key[1], secret or "", timeout_s)
                self.groups = [
                    open_group(store, lane_group_id(key[2], k), rank, key[4], timeout_s, key[5], device)
                    for k in range(key[6])
                ]
                self.key = key
            digests = [new_digest() for _ in self.groups]
            bucket_bytes = int(init_info.get("bucket_bytes", DEFAULT_BUCKET_BYTES))
            n = receive_lanes(self.groups, metas, update_info, bucket_bytes, device, load, digests)
            if key[5] == "nccl":
                import torch

                torch.cuda.synchronize(device)
            store = self.groups[0].base
            for k, h in enumerate(digests):
                expected = bytes(store.get(lane_digest_key(update_info["round_id"], k))).decode()
                if expected.startswith(ABORTED):
                    raise ValueError(
                        f"round {update_info['round_id']}: sender {k} aborted it ({expected}); "
                        "not acknowledged"
                    )
                if expected != h.hexdigest():
                    raise ValueError(
                        f"round {update_info['round_id']}: the weights received from sender {k} differ from what "
                        "it sent (digest mismatch); not acknowledged"
                    )
            if before_ack is not None:
                before_ack()
            store.set(ack_key(update_info["round_id"], rank), "1")
            return n
        except BaseException:
            self.groups = None  # a failed round poisons the groups: the next one opens new ones
            raise
