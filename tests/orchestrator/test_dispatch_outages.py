"""The one outage-retry loop under both dispatch modes: a lost request or a restarted server makes the step's
generation redo (step mode: the same prompts; continuous: every unfinished group again), the run goes on, and
a server that never comes back ends the run with one line naming the step."""

from __future__ import annotations

import asyncio
import logging

import pytest
from orch_fakes import FakeClient, make_orchestrator, small_config

from primejax.contracts.batch import read_batch, step_dir
from primejax.inference.server_pool import InferenceError
from primejax.orchestrator.outages import MAX_STEP_ATTEMPTS


class FlakyClient(FakeClient):
    """Loses the requests numbered in `lose` (counting from 0) as an unreachable server would."""

    def __init__(self, tokenizer, lose):
        super().__init__(tokenizer)
        self.lose = set(lose)
        self.calls = 0
        self.ready_waits = 0

    async def generate(self, prompt_token_ids, **kw):
        n, self.calls = self.calls, self.calls + 1
        if n in self.lose:
            self.requests.append({"prompt": list(prompt_token_ids), "lost": True})
            raise InferenceError("connection refused", status=None)
        return await super().generate(prompt_token_ids, **kw)

    async def wait_ready(self, timeout_s: float) -> None:
        self.ready_waits += 1


def _run(tmp_path, tokenizer, client, mode, steps=2):
    cfg = small_config(tmp_path / "run", batch_size=8, group_size=4)
    cfg.orchestrator.pool.mode = mode
    orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=tmp_path / "run")
    return asyncio.run(orch.run(steps))


@pytest.mark.parametrize("mode", ["step", "continuous"])
def test_a_lost_request_redoes_the_step_and_the_run_goes_on(tmp_path, tokenizer, mode, caplog):
    client = FlakyClient(tokenizer, lose={0})
    with caplog.at_level(logging.WARNING, logger="primejax.orchestrator.outages"):
        history = _run(tmp_path, tokenizer, client, mode)
    assert [m["batch/rollouts"] for m in history] == [8, 8]
    assert client.ready_waits == 1  # one outage, one wait for the server
    assert sum("step 1: inference outage (1 requests lost)" in r.message for r in caplog.records) == 1
    for step in (1, 2):
        assert read_batch(step_dir(tmp_path / "run", step) / "rank_0.npz").meta["num_samples"] == 8
    if mode == "step":  # the buffer was rewound: the redone step asks for the very prompts the lost one did
        first = [r["prompt"] for r in client.requests[:2]]
        redone = [r["prompt"] for r in client.requests[2:4]]
        assert sorted(map(tuple, first)) == sorted(map(tuple, redone))


def test_a_server_that_never_comes_back_ends_the_run_naming_the_step(tmp_path, tokenizer):
    # Step mode: every attempt loses requests. (The continuous pool re-dispatches a lost group by itself, so
    # there a dead server shows as a cut that waits; the loop and its limit are the same object.)
    client = FlakyClient(tokenizer, lose=range(10_000))
    with pytest.raises(
        RuntimeError, match=rf"step 1: inference failed in {MAX_STEP_ATTEMPTS} attempts in a row"
    ):
        _run(tmp_path, tokenizer, client, "step", steps=1)
    assert client.ready_waits == MAX_STEP_ATTEMPTS - 1
