"""The trainer -> orchestrator contract of a collective weight update: the offer file.

In collective mode (`trainer.broadcast.mode = "collective"`) the trainer, after step N, opens a transfer round
and writes `transfers/step_N.json` (atomically) saying where to join it and what it will send: the
weight-transfer engine's init info (rendezvous address, world size, timeout, bucket size) and update info
(HF tensor names, dtypes, shapes, the round id). The orchestrator hands both to every inference server
(`/transfer_weights`); the trainer deletes the offer when the round ends, whether it succeeded or not. A
failed round is followed by the filesystem broadcast `broadcasts/step_N/` (primejax.transports.weights.filesystem.broadcast).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primejax.contracts.rundir import RunDir
from primejax.utils.io import atomic_write_json

_PREFIX, _SUFFIX = "step_", ".json"


@dataclass(frozen=True)
class Offer:
    step: int
    init_info: dict[str, Any]
    update_info: dict[str, Any]


def transfers_root(run_dir: str | Path) -> Path:
    return RunDir(run_dir).transfers()


def offer_path(run_dir: str | Path, step: int) -> Path:
    return RunDir(run_dir).transfers(step)


def write_offer(run_dir: str | Path, offer: Offer) -> Path:
    path = offer_path(run_dir, offer.step)
    atomic_write_json(
        path,
        {"step": offer.step, "init_info": offer.init_info, "update_info": offer.update_info},
        indent=None,
    )
    return path


def remove_offer(run_dir: str | Path, step: int) -> None:
    try:
        os.unlink(offer_path(run_dir, step))
    except FileNotFoundError:
        pass


def latest_offer(run_dir: str | Path, skip: frozenset[int] | set[int] = frozenset()) -> Offer | None:
    """The newest readable offer whose step is not in `skip` (offers already tried), or None. An unreadable one
    (removed while read, malformed) is skipped."""
    root = transfers_root(run_dir)
    if not root.is_dir():
        return None
    steps = []
    for p in root.iterdir():
        digits = p.name.removeprefix(_PREFIX).removesuffix(_SUFFIX)
        if p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX) and digits.isdigit():
            steps.append(int(digits))
    for step in sorted(set(steps) - set(skip), reverse=True):
        try:
            raw = json.loads(offer_path(run_dir, step).read_text())
            return Offer(int(raw["step"]), dict(raw["init_info"]), dict(raw["update_info"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


async def rendezvous_listening(offer: Offer, timeout_s: float = 2.0) -> bool:
    """Whether something accepts connections at the offer's rendezvous address (its trainer is alive)."""
    try:
        host, port = str(offer.init_info["master_address"]), int(offer.init_info["master_port"])
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (TimeoutError, OSError, KeyError, TypeError, ValueError):
        return False
    writer.close()
    return True
