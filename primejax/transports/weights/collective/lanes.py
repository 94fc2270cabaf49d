"""One round with one or many senders: which sender sends which rows, in which buckets, in which order.

Every trainer process is a sender with its own *lane*: a process group of that sender (rank 0) and every
inference worker (ranks 1..R), opened under `group/<group_id>/<lane>/` in the one rendezvous store. A round's
update info lists the tensors (names, dtypes, shapes, as before) and, with several senders, `pieces`:
[tensor index, sender, first row, end row] (rows of dim 0; primejax.transports.weights.shards computes them from where
the trainer's devices hold the data). Without `pieces` every tensor is one piece of sender 0, the
single-sender round.

Each lane cuts its own pieces into buckets with the rule of `meta.unit_buckets` (vLLM's packed-broadcast rule).
Receivers take the lanes' buckets round-robin (lane 0's first, lane 1's first, ..., lane 0's second, ...):
the pieces of one tensor sit at about the same place in every lane, so a receiver holds only the tensors
that are partly arrived (about one bucket per lane) before handing them to the loader whole. Every side
derives the same schedule from the update info alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from primejax.transports.weights.collective import meta
from primejax.transports.weights.tensors import Piece, TensorMeta, piece_bytes, rows


def pieces_of(update_info: dict[str, Any], metas: Sequence[TensorMeta]) -> tuple[int, list[Piece]]:
    """(number of senders, the round's pieces), checked: every tensor's rows are covered exactly once; and the
    round's stacks (meta.stacks_of), so that the server refuses a lying manifest before it pauses."""
    meta.stacks_of(update_info, metas)
    senders = int(update_info.get("senders", 1))
    raw = update_info.get("pieces")
    if senders < 1:
        raise ValueError(f"update_info: senders = {senders}")
    if raw is None:
        return senders, [Piece(i, 0, 0, rows(m)) for i, m in enumerate(metas)]
    if not isinstance(raw, list):
        raise ValueError("update_info: 'pieces' must be a list of [tensor, sender, start, stop]")
    out = []
    for p in raw:
        if not (isinstance(p, list) and len(p) == 4 and all(isinstance(x, int) for x in p)):
            raise ValueError(f"update_info: malformed piece {p!r}")
        piece = Piece(*p)
        if not (0 <= piece.tensor < len(metas) and 0 <= piece.sender < senders):
            raise ValueError(f"update_info: piece {p!r} names no tensor or sender of the round")
        if not 0 <= piece.start < piece.stop <= rows(metas[piece.tensor]):
            raise ValueError(f"update_info: piece {p!r} lies outside {metas[piece.tensor].name}")
        out.append(piece)
    covered: dict[int, list[tuple[int, int]]] = {}
    for piece in out:
        covered.setdefault(piece.tensor, []).append((piece.start, piece.stop))
    for i, m in enumerate(metas):
        spans, at = sorted(covered.get(i, [])), 0
        for a, b in spans:
            if a != at:
                raise ValueError(f"update_info: the pieces of {m.name} do not cover its rows exactly once")
            at = b
        if at != rows(m):
            raise ValueError(f"update_info: the pieces of {m.name} do not cover its rows exactly once")
    return senders, out


def lane_buckets(
    metas: Sequence[TensorMeta], pieces: Sequence[Piece], senders: int, bucket_bytes: int
) -> list[list[list[int]]]:
    """Per lane, its buckets as indices into `pieces` (a lane's pieces in list order, cut as `meta.unit_buckets`)."""
    lanes: list[list[list[int]]] = [[] for _ in range(senders)]
    cur: list[list[int]] = [[] for _ in range(senders)]
    size = [0] * senders
    for j, p in enumerate(pieces):
        k = p.sender
        cur[k].append(j)
        size[k] += piece_bytes(metas[p.tensor], p)
        if size[k] > bucket_bytes:
            lanes[k].append(cur[k])
            cur[k], size[k] = [], 0
    for k in range(senders):
        if cur[k]:
            lanes[k].append(cur[k])
    return lanes


def schedule(lanes: Sequence[Sequence[Any]]) -> list[tuple[int, int]]:
    """(lane, bucket) in the order receivers take them: round-robin over the lanes."""
    out = []
    for j in range(max((len(b) for b in lanes), default=0)):
        out += [(k, j) for k in range(len(lanes)) if j < len(lanes[k])]
    return out


class Assembler:
    """A receiver's partly arrived tensors: pieces in, whole tensors out (a whole-tensor piece without a copy)."""

    def __init__(self, metas: Sequence[TensorMeta], device: Any):
        self.metas, self.device = metas, device
        self.partial: dict[int, tuple[Any, int]] = {}  # tensor -> (buffer, rows still missing)

    def add(self, piece: Piece, data: Any) -> tuple[str, Any] | None:
        """`data`: the piece's bytes (a uint8 torch tensor). Returns (name, tensor) once the tensor is whole."""
        import torch

        m = self.metas[piece.tensor]
        dtype = getattr(torch, m.dtype)
        n = rows(m)
        if piece.stop - piece.start == n:
            return m.name, data.view(dtype).view(m.shape)
        buf, missing = self.partial.get(piece.tensor) or (
            torch.empty(m.shape, dtype=dtype, device=self.device),
            n,
        )
        buf[piece.start : piece.stop].view(-1).copy_(data.view(dtype))
        missing -= piece.stop - piece.start
        if missing:
            self.partial[piece.tensor] = (buf, missing)
            return None
        self.partial.pop(piece.tensor, None)
        return m.name, buf

    def check_done(self) -> None:
        if self.partial:
            names = [self.metas[i].name for i in self.partial][:5]
            raise ValueError(f"round ended with tensors partly received: {names}")
