"""A round's update info and its cut into buckets: what sender and receiver both compute from metadata alone.

The names, dtypes and shapes travel over HTTP in the update info (field names as vLLM's NCCL engine's, plus the
round id and the wire version; an adapter round adds `ADAPTER_KEY`); the buckets are cut with vLLM's
packed-broadcast rule (wire.py).
Shared by the wire, the lanes and the server's checks.

Wire version 2 (issue 47) adds *stacks* to a single-sender round: runs of consecutive tensors of one dtype and
shape (the experts of a layer, one projection over the layers) that travel as one block `[count, *shape]` and are
never split by a bucket cut. The update info's `stacks` = [[first tensor, count], ...] is the bucket manifest:
every byte offset follows from it and the shapes, so no offset travels and none can lie; the receiver checks the
manifest before the server pauses (`stacks_of`). Per bucket both sides then handle a few blocks instead of one
tensor at a time (30B-A3B: 18,432 expert tensors), and the receiver views each block as a `[count, ...]` tensor
(no copy) that an MoE loader takes whole (fused.py). A peer speaking another version is refused in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from primejax.transports.weights.tensors import WIRE_DTYPES, TensorMeta

# update_info key of an adapter round (adapters/): the adapter's adapter_config.json.
ADAPTER_KEY = "adapter"
# The bytes' layout (module docstring). 1: every tensor alone, before issue 47 (a round without the key).
WIRE_VERSION = 2


def update_info(
    round_id: str, metas: Sequence[TensorMeta], stacks: Sequence[tuple[int, int]] = ()
) -> dict[str, Any]:
    """The JSON update info of one round (field names as vLLM's NCCL engine's, plus the round id, the wire
    version and the stacks: [first tensor, count] per block of several tensors)."""
    return {
        "round_id": round_id,
        "wire_version": WIRE_VERSION,
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [list(m.shape) for m in metas],
        "stacks": [[a, n] for a, n in stacks],
    }


def check_version(info: dict[str, Any]) -> None:
    """One line for a peer that lays the bytes out another way (its buckets would not match ours)."""
    v = info.get("wire_version", 1)
    if v != WIRE_VERSION:
        raise ValueError(
            f"update_info: the sender speaks weight-wire version {str(v)[:20]}, this side version {WIRE_VERSION}: "
            "run the same primejax on the trainer and the servers"
        )


def metas_from_update_info(info: dict[str, Any]) -> list[TensorMeta]:
    check_version(info)
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


def make_stacks(metas: Sequence[TensorMeta], max_bytes: int) -> list[tuple[int, int]]:
    """The sender's stacks: maximal runs of consecutive tensors of one dtype and shape, each cut to at most
    `max_bytes` (the bucket size, so a stack never makes a bucket much larger than before); runs of one are
    not stacks."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(metas):
        m, j = metas[i], i + 1
        per = max(1, max_bytes // max(m.nbytes, 1))
        while j < len(metas) and j - i < per and (metas[j].dtype, metas[j].shape) == (m.dtype, m.shape):
            j += 1
        if j - i > 1:
            out.append((i, j - i))
        i = j
    return out


def stacks_of(info: dict[str, Any], metas: Sequence[TensorMeta]) -> list[tuple[int, int]]:
    """The round's units in order, (first tensor, count), every tensor in exactly one: the update info's
    `stacks` checked (ordered, disjoint, inside the round, at least 2 tensors of one dtype and shape each; at
    most one per two tensors), the tensors between them units of one. ValueError, one line, otherwise."""
    raw = info.get("stacks") or []
    if not isinstance(raw, list) or len(raw) > len(metas) // 2:
        raise ValueError(f"update_info: 'stacks' must be a list of at most {len(metas) // 2} [first, count]")
    if raw and info.get("pieces") is not None:
        raise ValueError(
            "update_info: 'stacks' with 'pieces' (several senders send whole tensors or row blocks)"
        )
    units: list[tuple[int, int]] = []
    at = 0
    for s in raw:
        if not (isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s)):
            raise ValueError(f"update_info: malformed stack {str(s)[:100]}")
        a, n = s
        if not (at <= a and n >= 2 and a + n <= len(metas)):
            raise ValueError(
                f"update_info: stack {s} is out of order, overlaps, is shorter than 2 or lies outside the "
                f"round's {len(metas)} tensors"
            )
        m = metas[a]
        if any((metas[i].dtype, metas[i].shape) != (m.dtype, m.shape) for i in range(a + 1, a + n)):
            raise ValueError(f"update_info: stack {s} mixes dtypes or shapes")
        units += [(i, 1) for i in range(at, a)] + [(a, n)]
        at = a + n
    return units + [(i, 1) for i in range(at, len(metas))]


def unit_buckets(
    metas: Sequence[TensorMeta], units: Sequence[tuple[int, int]], bucket_bytes: int
) -> list[list[int]]:
    """Indices of `units` per bucket: add units until the bucket holds more than `bucket_bytes` (vLLM's
    packed-broadcast rule, wire.py; a stack is never split). Without stacks: vLLM's cut of the tensors."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for u, (a, n) in enumerate(units):
        cur.append(u)
        size += metas[a].nbytes * n
        if size > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out
