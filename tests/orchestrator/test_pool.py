"""The continuous rollout pool against a fake server on a fake clock: batches cut from finished groups, groups
carried over steps, the per-sample off-policy bound held by cancelling stale groups (their requests
cancelled), checkpoint/resume re-dispatching unfinished groups, a hung group timing out. Every config here is
the default one apart from sizes and timeouts: the continuous pool is the default mode."""

from __future__ import annotations

import asyncio
import time

import pytest
from orch_fakes import FakeClient, FakeClock, fake_broadcast, make_orchestrator, small_config

from primejax.contracts.batch import read_batch, step_dir
from primejax.envs.registry import register_env
from primejax.envs.reverse_text import ReverseText
from primejax.orchestrator.checkpoint import load_checkpoint
from primejax.orchestrator.policy import PolicyTracker, min_policy_version

STEPS = 6


class LongTailClient(FakeClient):
    """Every 5th request (by prompt) is slow by construction: it answers only once the served policy is two
    versions past the one it started under, so it outlives an update whatever the machine's speed (a fixed
    virtual delay did not: the batch writes run in a thread in real time, and on a loaded box the slow requests
    finished before the update). Counts requests cancelled mid-flight."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.cancelled, self.calls = 0, 0

    async def generate(self, prompt_token_ids, **kw):
        self.calls += 1
        slow = sum(prompt_token_ids) % 5 == 0
        try:
            if slow:
                started = self.served_version
                while self.served_version < started + 2:
                    await self.clock.sleep(self.gen_time)
            return await super().generate(prompt_token_ids, **kw)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


class Trainer:
    """Waits for rollouts/step_n, trains `train_time` virtual seconds, broadcasts θ_n."""

    def __init__(self, run_dir, clock: FakeClock, train_time: float):
        self.run_dir, self.clock, self.train_time = run_dir, clock, train_time

    async def run(self, max_steps: int) -> None:
        for n in range(1, max_steps + 1):
            while not step_dir(self.run_dir, n).exists():
                await self.clock.sleep(0.05)
            await self.clock.sleep(self.train_time)
            fake_broadcast(self.run_dir, n)


def run_continuous(tmp_path, tokenizer, *, k: int, steps: int = STEPS, oversampling: float = 1.0, **pool):
    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, batch_size=8, group_size=4, async_level=k)
    cfg.orchestrator.buffer.oversampling_factor = oversampling
    for key, value in pool.items():
        cfg.orchestrator.pool[key] = value
    clock = FakeClock()
    client = LongTailClient(tokenizer, clock=clock, gen_time=0.1)
    tracker = PolicyTracker(client, run_dir, poll_interval_s=0.05, sleep=clock.sleep, clock=clock.time)
    orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=run_dir, tracker=tracker)

    async def main():
        return (await asyncio.gather(orch.run(steps), Trainer(run_dir, clock, 0.3).run(steps)))[0]

    return run_dir, client, orch, asyncio.run(main())


@pytest.mark.parametrize("slow_box", [False, True])
def test_continuous_pool_keeps_every_sample_within_the_bound_and_cancels_stale_groups(
    tmp_path, tokenizer, monkeypatch, slow_box
):
    # Oversampling starts groups beyond the batch: the first finished fill it, and the slow ones outlive the update.
    if slow_box:  # a loaded machine: each batch write (in a thread, real time) takes 0.3 s longer
        from primejax.orchestrator.loop import Orchestrator

        write = Orchestrator.write

        def slow_write(self, *a, **kw):
            time.sleep(0.3)
            return write(self, *a, **kw)

        monkeypatch.setattr(Orchestrator, "write", slow_write)
    k = 0
    run_dir, client, orch, history = run_continuous(
        tmp_path, tokenizer, k=k, oversampling=2.0, groups_in_flight=6
    )
    for n in range(1, STEPS + 1):
        batch = read_batch(step_dir(run_dir, n) / "rank_0.npz", vocab_size=len(tokenizer))
        assert batch.meta["num_samples"] == 8
        assert batch.meta["min_policy_version"] >= min_policy_version(n, k), (
            f"step {n} trained a stale sample"
        )
        assert history[n - 1]["staleness/max"] <= k
    cancelled = sum(m.get("pool/cancelled_stale", 0) for m in history)
    # The slow requests outlive the update they started before: their groups were cancelled, and with them
    # their requests (the client saw them cancelled), not left running to be thrown away at the end. The two
    # counts differ either way: a group cancelled before its request started has none to cancel, and the
    # requests still running when the run ends are cancelled too.
    assert cancelled > 0 and client.cancelled > 0
    assert all("time/batch_cut_wait" in m and "pool/in_flight" in m for m in history)


def test_continuous_pool_carries_finished_groups_into_later_steps(tmp_path, tokenizer):
    # k = 2 leaves room to carry: the pool runs ahead (capacity 3 steps' groups) and later cuts find groups
    # that finished during an earlier step waiting for them.
    _, _, _, history = run_continuous(tmp_path, tokenizer, k=2, groups_in_flight=6)
    assert sum(m["pool/carried"] for m in history[:-1]) > 0
    assert max(m["pool/in_flight"] for m in history) > 0  # the pool was still working when a batch was cut
    assert all(m["staleness/max"] <= 2 for m in history)


def test_resume_dispatches_the_unfinished_groups_first(tmp_path, tokenizer):
    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, batch_size=8, group_size=4, async_level=8)
    cfg.orchestrator.pool.groups_in_flight = 6
    cfg.orchestrator.checkpoint.interval = 1
    client = FakeClient(tokenizer)
    orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=run_dir)
    asyncio.run(orch.run(2))
    state = load_checkpoint(run_dir, "2")
    pending = [tuple(p) for p in state["pending"]]
    assert pending, "the checkpoint must list the groups not yet cut"

    cfg.run.resume_step = "2"
    client2 = FakeClient(tokenizer)
    resumed = make_orchestrator(cfg, client=client2, tokenizer=tokenizer, run_dir=run_dir)
    resumed.resume("2")
    assert resumed.next_step == 3
    asyncio.run(resumed.run(3))
    slot = resumed.buffer.envs["reverse_text"]
    first = [tuple(r["prompt"]) for r in client2.requests[: len(pending)]]
    expected = [tuple(resumed.generator.renderer.render_ids(slot.env.example(i).prompt)) for _, i in pending]
    assert sorted(first) == sorted(expected)


class HangingReverse(ReverseText):
    """reverse-text whose scoring never returns for texts of even length (a hung environment)."""

    async def score(self, example, messages, state) -> float:
        if len(example.answer) % 2 == 0:
            await asyncio.Event().wait()
        return await super().score(example, messages, state)


def test_a_hung_group_times_out_and_the_pool_refills(tmp_path, tokenizer):
    register_env("hanging-reverse-text", lambda **_: HangingReverse(min_len=3, max_len=6))
    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, env_id="hanging-reverse-text", batch_size=8, group_size=4)
    cfg.orchestrator.pool.group_timeout_s = 0.3
    orch = make_orchestrator(cfg, client=FakeClient(tokenizer), tokenizer=tokenizer, run_dir=run_dir)
    history = asyncio.run(asyncio.wait_for(orch.run(3), 60))
    assert sum(m.get("pool/timed_out", 0) for m in history) > 0
    for n in (1, 2, 3):
        assert read_batch(step_dir(run_dir, n) / "rank_0.npz").meta["num_samples"] == 8


class FailingFirst(ReverseText):
    """Scoring raises for the first `n` rollouts (whole groups errored), then works."""

    def __init__(self, n: int):
        super().__init__(min_len=3, max_len=6)
        self.left = n

    async def score(self, example, messages, state):
        if self.left > 0:
            self.left -= 1
            raise ValueError("broken for now")
        return await super().score(example, messages, state)


def test_failed_groups_do_not_fill_the_pool_and_stall_it(tmp_path, tokenizer):
    register_env("failing-first", lambda **_: FailingFirst(8))
    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, env_id="failing-first", batch_size=8, group_size=4)
    cfg.orchestrator.pool.groups_in_flight = 2  # the two all-errored groups would hold every slot
    orch = make_orchestrator(cfg, client=FakeClient(tokenizer), tokenizer=tokenizer, run_dir=run_dir)
    history = asyncio.run(asyncio.wait_for(orch.run(2), 60))
    assert sum(m["errors/score"] for m in history if "errors/score" in m) == 8
    assert [m["batch/rollouts"] for m in history] == [8, 8]
