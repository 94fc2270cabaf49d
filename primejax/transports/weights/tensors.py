"""What every weight transport moves: HF tensors described by name, dtype and shape (`TensorMeta`), split by
rows into blocks (`Piece`) when several trainer processes each hold part of a tensor, and handed to torch as
views (DLPack). The row blocks are laid out by shards.py; the filesystem export writes them at their file
offsets, the collective lanes send them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# torch dtype names allowed on the wire (what an HF export can hold).
WIRE_DTYPES = ("bfloat16", "float16", "float32")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # a WIRE_DTYPES name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Piece:
    tensor: int  # index into the round's tensor list
    sender: int  # the process that sends it (its lane)
    start: int  # rows [start, stop) of dim 0 (a 0-d tensor has one row)
    stop: int


def rows(meta: TensorMeta) -> int:
    return meta.shape[0] if meta.shape else 1


def piece_bytes(meta: TensorMeta, piece: Piece) -> int:
    return meta.nbytes // max(rows(meta), 1) * (piece.stop - piece.start)


def dlpack_to_torch(x: Any) -> Any:
    """A torch view of an accelerator array's buffer (DLPack, no copy)."""
    import torch

    try:
        return torch.from_dlpack(x)
    except (TypeError, BufferError):  # an exporter that refuses torch's stream argument: the plain capsule
        return torch.from_dlpack(x.__dlpack__())
