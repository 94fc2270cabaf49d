"""The continuous pool against the real vLLM server: every batch within the off-policy bound while a fake
trainer publishes new weights, and a cancelled request really stops on the server (vLLM aborts it)."""

from __future__ import annotations

import asyncio

import pytest
from orch_fakes import make_orchestrator, small_config
from test_vllm_integration import fake_trainer

from primejax.contracts.batch import read_batch, step_dir
from primejax.inference.client import InferenceClient
from primejax.orchestrator.policy import min_policy_version
from primejax.rendering.renderer import load_tokenizer

pytestmark = pytest.mark.vllm
STEPS = 3  # fake_trainer broadcasts steps 1..3


def generated(page: bytes) -> float:
    """vLLM's count of tokens generated so far (from the client's undecoded /metrics page)."""
    text = page.decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total{")
    )


def test_continuous_pool_against_vllm_keeps_the_bound(tmp_path, vllm_server, tiny_model_dir):
    run_dir = tmp_path / "run"
    k = 0
    cfg = small_config(run_dir, batch_size=8, group_size=4, async_level=k)
    cfg.model.path = str(tiny_model_dir)
    cfg.orchestrator.update({"seq_len": 512, "max_prompt_tokens": 256})
    cfg.orchestrator.sampling.max_tokens = 24
    cfg.orchestrator.filters.post_batch = ()
    cfg.orchestrator.pool.groups_in_flight = 6  # the defaults otherwise: continuous pool, auto concurrency
    tokenizer = load_tokenizer(str(tiny_model_dir))

    async def main():
        client = InferenceClient(vllm_server.base_url, timeout_s=120, max_retries=2)
        try:
            orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=run_dir)
            await orch.tracker.sync_with_server()
            history = (await asyncio.gather(orch.run(STEPS), fake_trainer(run_dir, tiny_model_dir)))[0]
            assert orch.concurrency_mode == "aimd"  # auto: vLLM exposes its load metrics on /metrics
            return history
        finally:
            await client.reload_weights()  # the server is shared by the session: leave it as we found it
            await client.close()

    history = asyncio.run(main())
    for n in range(1, STEPS + 1):
        batch = read_batch(step_dir(run_dir, n) / "rank_0.npz", vocab_size=len(tokenizer))
        assert batch.meta["num_samples"] == 8
        assert batch.meta["min_policy_version"] >= min_policy_version(n, k)
    assert [m["policy/min_version"] for m in history] == [0, 1, 2]  # k = 0: each step trains on θ_{n-1}
    assert all(
        8 <= m["concurrency/limit"] <= cfg.orchestrator.max_concurrent for m in history
    )  # AIMD's range


def test_a_cancelled_request_is_aborted_on_the_server(vllm_server):
    """The pool cancels a stale group by cancelling its task; the client's request (the same transport path as
    `generate`) is then closed and vLLM stops generating for it: requests that cannot stop early (ignore_eos)
    end with far fewer than their max_tokens generated.

    The request carries many prompts so that it cannot finish before the cancel on a fast machine (one
    1,800-token prompt of the tiny model finished before the first poll on CI)."""
    prompts, max_tokens = 32, 1800
    total = prompts * max_tokens

    async def main():
        client = InferenceClient(vllm_server.base_url, timeout_s=120, max_retries=0)
        try:
            before = generated((await client.metrics_text())[0])
            body = {
                "prompt": [list(range(5 + i, 40 + i)) for i in range(prompts)],
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
            }
            task = asyncio.create_task(client._balanced("/v1/completions", body))
            now = before
            while now < before + 20 and not task.done():  # the engine is decoding it
                await asyncio.sleep(0.05)
                now = generated((await client.metrics_text())[0])
            assert not task.done(), "the request finished before it could be cancelled"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            last, stable = -1.0, 0
            while stable < 10:  # the counter stopped moving for 1 s: nothing decodes any more
                await asyncio.sleep(0.1)
                now = generated((await client.metrics_text())[0])
                stable = stable + 1 if now == last else 0
                last = now
            return last - before
        finally:
            await client.close()

    produced = asyncio.run(main())
    assert 20 <= produced < total / 2, f"{produced} of {total} tokens generated after the cancel"
