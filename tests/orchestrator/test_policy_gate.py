"""The off-policy gate against a fake trainer on a fake clock: step N never samples a policy older than
θ_{N-1-k} (staleness <= k), and when the trainer is the bottleneck the orchestrator runs exactly k ahead."""

from __future__ import annotations

import asyncio

import pytest
from orch_fakes import FakeClient, FakeClock, fake_broadcast, make_orchestrator, small_config

from primejax.contracts.batch import read_batch, step_dir
from primejax.orchestrator.policy import PolicyTracker, min_policy_version, staleness

MAX_STEPS = 6


class FakeTrainer:
    """Waits for rollouts/step_n, 'trains' for `train_time` virtual seconds, broadcasts θ_n."""

    def __init__(self, run_dir, clock: FakeClock, train_time: float):
        self.run_dir, self.clock, self.train_time = run_dir, clock, train_time

    async def run(self, max_steps: int) -> None:
        for n in range(1, max_steps + 1):
            while not step_dir(self.run_dir, n).exists():
                await self.clock.sleep(0.1)
            await self.clock.sleep(self.train_time)
            fake_broadcast(self.run_dir, n)


class StepRecorder:
    """A monitor that remembers where each step's requests end in the client's log."""

    def __init__(self, client: FakeClient):
        self.client, self.ends, self.metrics = client, {}, {}

    def scalars(self, step, values):
        self.ends[step] = len(self.client.served)
        self.metrics[step] = dict(values)

    def histogram(self, *a):
        pass

    def text(self, *a):
        pass


def test_min_policy_version_formula():
    assert [min_policy_version(n, 0) for n in (1, 2, 3)] == [0, 1, 2]
    assert [min_policy_version(n, 1) for n in (1, 2, 3)] == [0, 0, 1]
    assert [min_policy_version(n, 2) for n in (1, 2, 3, 4)] == [0, 0, 0, 1]
    assert staleness(5, 4) == 0 and staleness(5, 2) == 2


@pytest.mark.parametrize("mode", ["continuous", "step"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_step_never_samples_a_policy_older_than_the_bound(tmp_path, tokenizer, k, mode):
    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, async_level=k)
    cfg.orchestrator.pool.mode = mode
    clock = FakeClock()
    client = FakeClient(tokenizer, clock=clock, gen_time=0.1)
    tracker = PolicyTracker(client, run_dir, poll_interval_s=0.1, sleep=clock.sleep, clock=clock.time)
    recorder = StepRecorder(client)
    orch = make_orchestrator(
        cfg, client=client, tokenizer=tokenizer, run_dir=run_dir, monitor=recorder, tracker=tracker
    )
    trainer = FakeTrainer(run_dir, clock, train_time=2.0)  # the trainer is the bottleneck

    async def main():
        await asyncio.gather(orch.run(MAX_STEPS), trainer.run(MAX_STEPS))

    asyncio.run(main())

    start = 0
    for n in range(1, MAX_STEPS + 1):
        served = client.served[start : recorder.ends[n]]
        start = recorder.ends[n]
        if mode == "step":  # the barrier: the requests made between two steps' logs are that step's
            assert served, f"step {n} made no request"
            assert min(served) >= min_policy_version(n, k), f"step {n} sampled θ_{min(served)} with k={k}"
        # the pool dispatches ahead of its steps: its bound holds per sample, in the batch (and in
        # tests/orchestrator/test_pool_bound.py per request)
        batch = read_batch(step_dir(run_dir, n) / "rank_0.npz")
        assert batch.meta["min_policy_version"] >= min_policy_version(n, k)
        assert recorder.metrics[n]["staleness/max"] <= k
    # The trainer is slow, so the orchestrator uses all the slack it is allowed: staleness reaches k.
    assert max(m["staleness/max"] for m in recorder.metrics.values()) == k
    if k == 0:  # fully synchronous: every step samples the newest policy, θ_{N-1}
        assert [recorder.metrics[n]["policy/min_version"] for n in range(1, MAX_STEPS + 1)] == list(
            range(MAX_STEPS)
        )
    # The watcher told the server about broadcasts in order, each once.
    versions = [v for _, v in client.updates]
    assert versions == sorted(set(versions)) and versions[-1] >= min_policy_version(MAX_STEPS, k)
    assert all(str(run_dir / "broadcasts") in d for d, _ in client.updates)
