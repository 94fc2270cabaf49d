"""A round's update info and its cut into buckets: what sender and receiver both compute from metadata alone.

The names, dtypes and shapes travel over HTTP in the update info (field names as vLLM's NCCL engine's, plus the
round id; an adapter round adds `ADAPTER_KEY`); the buckets are cut with vLLM's packed-broadcast rule (wire.py).
Shared by the wire, the lanes and the server's checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from primejax.transports.weights.tensors import WIRE_DTYPES, TensorMeta

# update_info key of an adapter round (adapters/): the adapter's adapter_config.json.
ADAPTER_KEY = "adapter"


def update_info(round_id: str, metas: Sequence[TensorMeta]) -> dict[str, Any]:
    """The JSON update info of one round (field names as vLLM's NCCL engine's, plus the round id)."""
    return {
        "round_id": round_id,
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def metas_from_update_info(info: dict[str, Any]) -> list[TensorMeta]:
    names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"update_info: {len(names)} names, {len(dtypes)} dtype_names, {len(shapes)} shapes")
    for d in dtypes:
        if d not in WIRE_DTYPES:
            raise ValueError(f"update_info: dtype {d!r} is not one of {WIRE_DTYPES}")
    for n, s in zip(names, shapes, strict=True):
        # JSON integers only: a float (1e400 is inf), a string or a bool is a malformed offer, not a dimension
        if (
            not isinstance(n, str)
            or not isinstance(s, list)
            or any(isinstance(x, bool) or not isinstance(x, int) for x in s)
        ):
            raise ValueError(
                f"update_info: tensor {str(n)[:100]!r}: shape {str(s)[:100]} is not a list of integers"
            )
    return [TensorMeta(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]


def buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Indices of `metas` per bucket: add tensors until the bucket holds more than `bucket_bytes`."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, m in enumerate(metas):
        cur.append(i)
        size += m.nbytes
        if size > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out
