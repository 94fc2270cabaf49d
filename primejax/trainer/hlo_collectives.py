"""Collective volumes of a compiled program, from its optimized HLO text: bytes per device per step, by kind.

    collective_bytes(compiled.as_text()) -> {"all-gather": bytes, "all-to-all": bytes, ...}
    collective_bytes(text, within_loops=True) -> the same, of the collectives that run inside a `while` body

Each collective counts its result's bytes on one device (an all-gather's gathered output, a reduce-scatter's
scattered output, an all-to-all's exchanged buffer), times the number of times its computation runs: a
`while` body counts its trip count, nested loops multiply, conditional branches count once each (an upper
bound). Asynchronous pairs count once, at their `-start`. A compile-time figure of what the program moves,
not a measured time.

What the TPU compiler emits, and this reads (tests/tpu/test_hlo_collectives.py holds excerpts):
- Signatures and tuples of more than five elements carry `/*index=5*/` comments; they are dropped first (an
  `=` in a computation's header once hid every header from the parser, and the result was {}).
- A `while` has no `known_trip_count` in its backend config (the CPU and GPU compilers write one); the count is
  read from the condition computation, `ROOT compare(counter, constant(N)), direction=LT`, less the counter's
  start when the loop's init tuple gives it as a constant (a loop with peeled iterations starts past 0): a
  scan's or a fori_loop's counter steps by 1.
- An asynchronous collective is a chain of fusions (`async-collective-start`, `async_collective_fusion`
  continuations, `async-collective-done`), each calling a computation that holds a copy of the same
  collective (same `chain_id` and `channel_id`): a chain counts once in the computation that runs it.
- An all-gather can be an all-reduce of a zero buffer holding this device's shard (a `dynamic-update-slice`,
  or a fusion ending in one, is every operand; the TPU compiler does this on larger slices, e.g. the FSDP
  weight gathers of the Qwen3-235B-A22B step on v5p-128): it counts under "all-gather-via-all-reduce", the
  gathered bytes, apart from the all-reduces that sum (a ring moves about twice an all-gather's bytes for
  it).
- A reduce-scatter can be an `all-reduce-scatter` fusion (an all-reduce then this device's slice): it counts
  as a reduce-scatter of the fused computation's result.
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
GATHER_AS_ALL_REDUCE = "all-gather-via-all-reduce"
_ITEM = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*?\)\s*->\s*(.*)\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_OP = re.compile(r"=\s*(\(.*?\)|[\w]+\[[^\]]*\](?:\{[^}]*\})?)\s+([\w\-]+)\(([^)]*)\)")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_FUSED = re.compile(r"\bcalls=%?([\w.\-]+)")
_LOOP = re.compile(r"\b(body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_CHAIN = re.compile(r'\bchain_id="(\d+)"')
_CONST = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*[su](?:8|16|32|64)\[\]\S*\s+constant\((-?\d+)\)")
_DIRECTION = re.compile(r"direction=(LT|GT)")
_ALL_REDUCE_SCATTER = "all-reduce-scatter"


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


def _condition_trip(constants: dict[str, int], root: str) -> int | None:
    """N of a loop condition `ROOT compare(counter, N), direction=LT` (or `compare(N, counter), GT`)."""
    op = _OP.search(root)
    direction = _DIRECTION.search(root)
    if op is None or op.group(2) != "compare" or direction is None:
        return None
    args = [a.strip().lstrip("%") for a in op.group(3).split(",")]
    if len(args) != 2:
        return None
    bound = constants.get(args[1] if direction.group(1) == "LT" else args[0])
    return bound if bound is not None and bound > 0 else None


def collective_bytes(hlo: str, within_loops: bool = False) -> dict[str, int]:
    """{kind: bytes per device per step} of every collective in the optimized HLO module text `hlo`; with
    `within_loops`, only of those that run inside a `while` body (a scan's layers, for example), however deep."""
    # per computation: {async chain or instruction: (kind, bytes, operands)}; fusion/call callees; loop callees
    own: dict[str, dict[str, tuple[str, int, list[str]]]] = defaultdict(dict)
    opcode: dict[str, dict[str, tuple[str, str]]] = defaultdict(dict)  # name -> (opcode, fused callee)
    root_opcode: dict[str, str] = {}
    fused: dict[str, list[str]] = defaultdict(list)
    # per computation: (callee, its runs per call, whether it is a while body)
    loops: dict[str, list[tuple[str, int | tuple[str, int], bool]]] = defaultdict(list)
    constants: dict[str, dict[str, int]] = defaultdict(dict)
    first_of_tuple: dict[str, dict[str, str]] = defaultdict(dict)  # a tuple instruction's first operand
    roots: dict[str, str] = {}
    entry, comp, result = None, None, ""
    for raw in hlo.splitlines():
        line = _COMMENT.sub("", raw)
        if line[:1] not in ("", " ", "\t") and not line.startswith("HloModule"):
            head = _HEADER.match(line)
            if head:
                comp, result = head.group(2), head.group(3)
                if head.group(1):
                    entry = comp
            continue
        if comp is None or not (name := _NAME.match(line)):
            continue
        if line.lstrip().startswith("ROOT"):
            roots[comp] = line
        if c := _CONST.match(line):
            constants[comp][c.group(1)] = int(c.group(2))
        op = _OP.search(line)
        if op:
            callee = _FUSED.search(line)
            opcode[comp][name.group(1)] = (op.group(2), callee.group(1) if callee else "")
            if line.lstrip().startswith("ROOT"):
                root_opcode[comp] = op.group(2)
        if op and op.group(2) == "tuple":
            first_of_tuple[comp][name.group(1)] = op.group(3).split(",")[0].strip().lstrip("%")
        if op and (kind := _kind(op.group(2))):
            shape, start = op.group(1), op.group(2).endswith("-start")
            if kind == "all-reduce" and comp.startswith(_ALL_REDUCE_SCATTER):
                kind, shape, start = "reduce-scatter", result, False
            # one async chain's copies share a chain_id and a channel; other collectives may share a channel
            # (two psums of one shard_map both carry channel_id=1) and each counts
            channel, chain = _CHANNEL.search(line), _CHAIN.search(line)
            key = (
                f"chain {chain.group(1)}/{channel.group(1)}"
                if chain and channel
                else f"{comp}/{name.group(1)}"
            )
            operands = [a.strip().lstrip("%") for a in op.group(3).split(",") if a.strip()]
            own[comp][key] = (kind, _bytes(shape, start), operands)
        fused[comp] += _FUSED.findall(line)
        trip = _TRIP.search(line)
        is_while = op is not None and op.group(2) == "while"
        cond = None
        for role, callee in _LOOP.findall(line):
            if role == "condition":
                cond = callee
        for role, callee in _LOOP.findall(line):
            if role == "body" and is_while:
                # the backend's count when it wrote one, else the condition's bound less the counter's start
                init = op.group(3).split(",")[0].strip().lstrip("%")
                start = constants[comp].get(first_of_tuple[comp].get(init, ""), 0)
                loops[comp].append((callee, int(trip.group(1)) if trip else (str(cond), start), True))
            else:
                loops[comp].append((callee, 1, False))
        for m in _BRANCHES.finditer(line):
            loops[comp] += [(b.strip().lstrip("%"), 1, False) for b in m.group(1).split(",") if b.strip()]
    if entry is None:
        return {}

    def shard_in_zeros(comp: str, operand: str) -> bool:
        code, callee = opcode[comp].get(operand, ("", ""))
        return code == "dynamic-update-slice" or (
            code == "fusion" and root_opcode.get(callee) == "dynamic-update-slice"
        )

    for comp, collectives in own.items():
        for key, (kind, b, operands) in collectives.items():
            if kind == "all-reduce" and operands and all(shard_in_zeros(comp, a) for a in operands):
                collectives[key] = (GATHER_AS_ALL_REDUCE, b, operands)

    def trips(mult: int | tuple[str, int]) -> int:
        if isinstance(mult, int):
            return mult
        cond, start = mult
        bound = _condition_trip(constants.get(cond, {}), roots.get(cond, ""))
        return bound - start if bound is not None and bound > start else 1

    total: dict[str, int] = defaultdict(int)

    def gather(name: str, found: dict, loops_out: list, depth: int) -> None:
        """The collectives of `name` and of the computations its fusions and calls run, once per call; an
        async chain's copies once in all."""
        if depth > 64:
            return
        for key, (kind, b, _) in own.get(name, {}).items():
            runs = 1 if key.startswith("chain ") else found.get(key, (kind, b, 0))[2] + 1
            found[key] = (kind, b, runs)
        loops_out += loops.get(name, ())
        for callee in fused.get(name, ()):
            gather(callee, found, loops_out, depth + 1)

    def visit(name: str, times: int, in_loop: bool, depth: int = 0) -> None:
        if depth > 64:
            return
        found: dict[str, tuple[str, int, int]] = {}
        inner: list[tuple[str, int | tuple[str, int], bool]] = []
        gather(name, found, inner, depth)
        if in_loop or not within_loops:
            for kind, b, runs in found.values():
                total[kind] += b * runs * times
        for callee, mult, body in inner:
            visit(callee, times * trips(mult), in_loop or body, depth + 1)

    visit(entry, 1, False)
    return dict(total)
