"""A crashed trainer's leftover `transfers/step_N.json` neither stalls nor misleads the next run (issue 27): a
fresh start and a resume set offers aside, and the weights' watcher skips, at once, an offer no live trainer
listens for, so the live trainer's offer of an earlier step is the one loaded."""

from __future__ import annotations

import asyncio
import socket

from primejax.contracts.rundir import RunDir
from primejax.launcher.resume import keep_previous_run, set_aside_after
from primejax.orchestrator.policy import PolicyTracker
from primejax.transports.weights.collective.offer import Offer, latest_offer, write_offer


class Client:
    def __init__(self):
        self.transfers: list[int] = []

    async def transfer_weights(self, version, init_info, update_info):
        self.transfers.append(version)


def _offer(step: int, port: int) -> Offer:
    info = {"master_address": "127.0.0.1", "master_port": port, "group_id": "g", "world_size": 2}
    return Offer(step, info, {"round_id": f"{step}-x", "names": [], "dtype_names": [], "shapes": []})


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on return: nothing listens there


def test_the_watcher_skips_a_dead_trainers_offer_and_loads_the_live_one(tmp_path):
    live = socket.create_server(("127.0.0.1", 0))
    try:
        write_offer(tmp_path, _offer(5, _dead_port()))  # left by a trainer killed at step 5
        write_offer(tmp_path, _offer(1, live.getsockname()[1]))  # the new trainer, sending step 1
        client = Client()
        tracker = PolicyTracker(client, tmp_path)
        assert asyncio.run(tracker.refresh())
        assert client.transfers == [1] and tracker.version == 1
        assert 5 in tracker.failed_offers
    finally:
        live.close()


def test_fresh_starts_and_resumes_set_offers_aside(tmp_path):
    run = RunDir(tmp_path / "run")
    write_offer(run.root, _offer(7, 1))
    moved = set_aside_after(run.root, 2)
    assert latest_offer(run.root) is None and any(p.name == "step_7.json" for p in moved)
    write_offer(run.root, _offer(3, 1))
    kept = keep_previous_run(run.root)
    assert latest_offer(run.root) is None and (kept / "transfers" / "step_3.json").is_file()
