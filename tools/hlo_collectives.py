"""Collective volumes of a compiled program, from its optimized HLO text: bytes per device per step, by kind.

    collective_bytes(compiled.as_text()) -> {"all-gather": bytes, "all-to-all": bytes, ...}

Each collective counts its result's bytes on one device (an all-gather's gathered output, a reduce-scatter's
scattered output, an all-to-all's exchanged buffer), times the number of times its computation runs: a
`while` body counts its known trip count (XLA's `known_trip_count` on the loop, e.g. the scanned layers),
nested loops multiply, conditional branches count once each (an upper bound). Asynchronous pairs count once,
at their `-start`. A compile-time figure of what the program moves, not a measured time.
"""

from __future__ import annotations

import re
from collections import defaultdict

KINDS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
_ITEM = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*(\(.*?\)|[\w]+\[[^\]]*\](?:\{[^}]*\})?)\s+([\w\-]+)\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _bytes(shape: str, start: bool) -> int:
    """Bytes of an HLO result shape: an async start's last tuple element (its output buffer), else every
    element of a tuple (an all-to-all split into one operand per peer)."""
    found = _SHAPE.findall(shape)
    total = 0
    for dtype, dims in found[-1:] if start else found:
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _ITEM.get(dtype, 4)
    return total


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    if opcode.endswith("-done") or base not in KINDS:
        return None
    return base


def collective_bytes(hlo: str) -> dict[str, int]:
    """{kind: bytes per device per step} of every collective in the optimized HLO module text `hlo`."""
    own: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    entry, comp = None, None
    for line in hlo.splitlines():
        head = _HEADER.match(line)
        if head and "=" not in line.split("{")[0]:
            comp = head.group(1)
            if line.startswith("ENTRY"):
                entry = comp
            continue
        if comp is None:
            continue
        op = _OP.search(line)
        if op and (kind := _kind(op.group(2))):
            own[comp][kind] += _bytes(op.group(1), op.group(2).endswith("-start"))
        trip = _TRIP.search(line)
        is_while = op is not None and op.group(2) == "while"
        for m in _CALLS.finditer(line):
            body = m.group(0).startswith("body=")
            edges[comp].append((m.group(1), int(trip.group(1)) if (is_while and body and trip) else 1))
        for m in _BRANCHES.finditer(line):
            edges[comp] += [(b.strip().lstrip("%"), 1) for b in m.group(1).split(",") if b.strip()]
    if entry is None:
        return {}
    total: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            return
        for kind, b in own.get(name, {}).items():
            total[kind] += b * times
        for callee, mult in edges.get(name, ()):
            visit(callee, times * mult, depth + 1)

    visit(entry, 1)
    return dict(total)
