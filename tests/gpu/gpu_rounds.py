"""What the GPU tier's weight-update tests share: an admin POST, one collective round (perturbed weights:
tests/transfer/perturbed.py).

Imported by the tests beside it (pytest puts this folder on sys.path, as for gpu_env.py).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx

from primejax.inference import InferenceClient
from primejax.inference.admin_auth import HEADER, read_token
from primejax.transports.weights.collective.offer import latest_offer


def post(url: str, path: str, body: dict | None = None, timeout: float = 300) -> httpx.Response:
    """An admin call (the run's secret in its header)."""
    return httpx.post(url + path, json=body, headers={HEADER: read_token()}, timeout=timeout)


def wait_offer(run_dir: Path, step: int | None = None, polls: int = 1200, gone: object = None) -> object:
    """The sender's offer in `run_dir` (of `step` when given), polled every 50 ms; None when none came or
    `gone()` (e.g. the sender process ended) says to stop looking."""
    offer = None
    for _ in range(polls):
        offer = latest_offer(run_dir)
        if (offer is not None and (step is None or offer.step == step)) or (gone is not None and gone()):
            break
        threading.Event().wait(0.05)
    return offer if offer is not None and (step is None or offer.step == step) else None


def collective_round(
    url: str, sender: object, run_dir: Path, step: int, tensors: list, polls: int = 1200
) -> None:
    """`sender.send(step, tensors)` on a thread, the server told of its offer (POST /transfer_weights through
    the client, as the orchestrator does), and the sender's acknowledgement required."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(ok=sender.send(step, tensors)))  # type: ignore[attr-defined]
    thread.start()
    offer = wait_offer(run_dir, step, polls)
    assert offer is not None, "the sender wrote no offer"

    async def transfer() -> None:
        async with InferenceClient(url) as c:
            await c.transfer_weights(offer.step, offer.init_info, offer.update_info)

    asyncio.run(transfer())
    thread.join(300)
    assert result.get("ok"), "the sender saw no acknowledgement"
