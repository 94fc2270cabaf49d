"""Two vLLM replicas behind one orchestrator in continuous mode, one killed mid-run and started again: the run
goes on, every step's batch is full and within the off-policy bound, the replica returns on the tracked weights
and serves rollouts again, and weight updates reach both."""

from __future__ import annotations

import asyncio
import socket

import pytest
from orch_fakes import make_orchestrator, small_config
from test_vllm_integration import write_perturbed

from primejax.contracts.batch import read_batch, step_dir
from primejax.inference.client import InferenceClient
from primejax.inference.process import InferenceServerProcess
from primejax.inference.server import ServerSpec
from primejax.orchestrator.policy import min_policy_version
from primejax.rendering.renderer import load_tokenizer
from primejax.transports.weights.filesystem.broadcast import write_broadcast

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
STEPS = 3
SERVER_STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RoutedClient(InferenceClient):
    """The real client, remembering which replica each generation request went to."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.routed: list[str] = []

    def _pick(self) -> str:
        url = super()._pick()
        self.routed.append(url)
        return url


def test_a_replica_killed_mid_run_returns_and_the_run_keeps_the_bound(tmp_path, vllm_server, tiny_model_dir):
    run_dir = tmp_path / "run"
    k = 0  # step n waits for θ_{n-1}: step 3 starts only after the killed replica is back (see trainer below)
    cfg = small_config(run_dir, batch_size=8, group_size=4, async_level=k)
    cfg.model.path = str(tiny_model_dir)
    cfg.orchestrator.update({"seq_len": 512, "max_prompt_tokens": 256})
    cfg.orchestrator.sampling.max_tokens = 24
    cfg.orchestrator.filters.post_batch = ()
    cfg.orchestrator.pool.groups_in_flight = 6  # the defaults otherwise: continuous pool, auto concurrency
    tokenizer = load_tokenizer(str(tiny_model_dir))
    spec = ServerSpec(model=str(tiny_model_dir), port=free_port(), dtype="float32", max_model_len=2048)
    second = InferenceServerProcess(spec, tmp_path / "inference_1.log")
    second.start()
    events: dict[str, int] = {}

    async def trainer(client: RoutedClient) -> None:
        for n in range(1, STEPS + 1):
            while not step_dir(run_dir, n).exists():
                await asyncio.sleep(0.05)
            if n == 1:  # kill the second replica with requests in flight, then start it again
                second.stop(grace_s=0.0)
                events["killed_at"] = len(client.routed)
                second.start()
                await asyncio.to_thread(second.wait_healthy, SERVER_STARTUP_TIMEOUT_S)
                while spec.base_url in client.down or spec.base_url not in client.up_urls:
                    await asyncio.sleep(0.1)  # the tracker revives it once it is back on the tracked weights
                events["revived_at"] = len(client.routed)
            write_broadcast(run_dir, n, lambda d, n=n: write_perturbed(tiny_model_dir, d, seed=n))

    async def main():
        await asyncio.to_thread(second.wait_healthy, SERVER_STARTUP_TIMEOUT_S)
        client = RoutedClient(
            [vllm_server.base_url, spec.base_url], timeout_s=120, max_retries=1, backoff_s=0.1
        )
        try:
            orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=run_dir)
            await orch.tracker.sync_with_server()
            history = (await asyncio.gather(orch.run(STEPS), trainer(client)))[0]
            assert orch.concurrency_mode == "aimd"  # auto: the replicas expose vLLM's load metrics
            await orch.tracker.refresh()
            versions = [await client.server_version(u) for u in client.base_urls]
            return client.routed, history, versions, orch.tracker.version
        finally:
            await client.reload_weights()  # the session's server: leave it on the base model
            await client.close()

    try:
        routed, history, versions, tracked = asyncio.run(main())
    finally:
        second.stop()
    for n in range(1, STEPS + 1):
        batch = read_batch(step_dir(run_dir, n) / "rank_0.npz", vocab_size=len(tokenizer))
        assert batch.meta["num_samples"] == 8, f"step {n} lost samples"
        assert batch.meta["min_policy_version"] >= min_policy_version(n, k)
    # Both replicas served before the kill, and the returned one serves rollouts again after it is revived.
    assert spec.base_url in routed[: events["killed_at"]]
    assert spec.base_url in routed[events["revived_at"] :]
    assert versions == [tracked, tracked] and tracked >= STEPS - 1  # updates reached both replicas
