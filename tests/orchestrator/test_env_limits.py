"""Limits per environment (orchestrator.envs.<name>.limits, primejax/envs/env_limits.py): two envs share the
request slots, one of them slow; its max_concurrent keeps the other running; its timeout_s errors an episode
that runs too long; tool calls are paced to tool_calls_per_s."""

from __future__ import annotations

import asyncio

import pytest
from orch_fakes import FakeClient, make_orchestrator, small_config

from primejax.config import env
from primejax.envs.base import Environment, Example, SampledRollout, SampledTurn
from primejax.envs.env_limits import EnvLimits, EnvLimitsConfig, Pacer, pace_tool_call
from primejax.envs.reverse_text import ReverseText
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.rendering.renderer import build_renderer


class Version:
    version = 1


class Scorer:
    async def finalize_rollout(self, rollout):
        rollout.assign_advantages(1.0)


class Endpoint:
    async def openai_endpoint(self):
        return "http://127.0.0.1:1", "model"


class SelfSampled(Environment):
    """An env that samples its own episodes (like verifiers' loop and env server: an episode holds a request
    slot throughout); with a `gate`, each episode waits for it (a slow env)."""

    samples_itself = True

    def __init__(self, gate: asyncio.Event | None = None):
        self.gate, self.entered, self.inside, self.most_inside = gate, asyncio.Event(), 0, 0

    def example(self, index: int) -> Example:
        return Example(key=str(index), prompt=[{"role": "user", "content": "hi"}])

    async def sample_rollout(self, example, state, endpoint) -> SampledRollout:
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        self.entered.set()
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.inside -= 1
        return SampledRollout(messages=[{"role": "assistant", "content": "ok"}],
                              turns=[SampledTurn([1, 2], [3], [-0.1])])  # fmt: skip

    async def score(self, example, messages, state) -> float:
        return 1.0


def _slot(name, env, **limits):
    return EnvSlot(name=name, env=env, weight=1.0, algorithm=Scorer(),
                   limits=EnvLimits(EnvLimitsConfig(**limits), name))  # fmt: skip


@pytest.mark.parametrize("limited", [True, False])
def test_a_slow_env_at_its_cap_leaves_request_slots_to_the_other(tokenizer, limited):
    async def main():
        gate = asyncio.Event()
        slow = _slot("slow", SelfSampled(gate), max_concurrent=1 if limited else 0)
        fast = _slot("fast", SelfSampled())
        gen = GroupGenerator(Endpoint(), build_renderer("default", tokenizer), SamplingConfig(max_tokens=8),
                             Version(), max_concurrent=2, max_prompt_tokens=64)  # fmt: skip
        slow_group = asyncio.ensure_future(gen.group(slow, 0, 0, 4, step=1))
        await slow.env.entered.wait()
        fast_group = asyncio.ensure_future(gen.group(fast, 0, 1, 4, step=1))
        # without the cap the slow env's episodes hold both request slots until it is released: the fast env
        # cannot finish however long it is given; with it the fast env finishes while the slow one still waits
        done, _ = await asyncio.wait({fast_group}, timeout=30 if limited else 1)
        fast_finished = fast_group in done
        gate.set()
        return fast_finished, await slow_group, await fast_group, slow.env.most_inside

    fast_finished, slow_rollouts, fast_rollouts, most_inside = asyncio.run(main())
    assert fast_finished is limited
    assert all(r.ok for r in slow_rollouts + fast_rollouts)
    assert most_inside == (1 if limited else 2)


def test_an_episode_past_its_env_timeout_errors_naming_the_key(tokenizer):
    async def main():
        slow = _slot("slow", SelfSampled(asyncio.Event()), timeout_s=0.2)  # never released
        gen = GroupGenerator(Endpoint(), build_renderer("default", tokenizer), SamplingConfig(max_tokens=8),
                             Version(), max_concurrent=2, max_prompt_tokens=64)  # fmt: skip
        return await gen.group(slow, 0, 0, 2, step=1)

    rollouts = asyncio.run(main())
    for r in rollouts:
        assert not r.ok and "ran past 0.2 s (orchestrator.envs.slow.limits.timeout_s)" in r.error


def test_tool_calls_are_paced_within_an_episode_only():
    slept: list[float] = []
    now = [100.0]

    async def sleep(dt):
        slept.append(dt)
        now[0] += dt

    async def main():
        limits = EnvLimits(EnvLimitsConfig(tool_calls_per_s=4), "tools")
        limits._pacer = Pacer(4, clock=lambda: now[0], sleep=sleep)
        await pace_tool_call()  # no episode running: no pacing
        async with limits.episode():
            for _ in range(5):
                await pace_tool_call()
        await pace_tool_call()

    asyncio.run(main())
    assert slept == [0.25, 0.25, 0.25, 0.25]  # 5 calls at 4/s: the first at once, then 1/4 s apart


class Gated(ReverseText):
    """reverse-text with a second turn that waits for `gate` (a slow tool: the episode holds its slot)."""

    max_turns = 2

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = asyncio.Event()

    async def env_response(self, example, messages, state):
        if sum(m["role"] == "assistant" for m in messages) > 1:
            return None
        await self.gate.wait()
        return [{"role": "user", "content": "again"}]


def load_gated(**kw) -> Gated:
    return Gated(**kw)


def test_the_continuous_pool_keeps_a_slow_env_at_its_cap_and_the_other_env_running(tmp_path, tokenizer):
    # The pool holds 4 groups. Without the cap the slow env's groups (waiting for its 2 episode slots) fill all 4
    # and the fast env never runs again: no cut completes. With it at most ceil(2 / 2) = 1 slow group runs and
    # every batch comes from the fast env while that group waits.
    cfg = small_config(tmp_path / "run", batch_size=4, group_size=2)
    o = cfg.orchestrator
    o.pool.mode, o.pool.groups_in_flight = "continuous", 4
    o.envs.slow = env("test_env_limits:load_gated")
    o.envs.slow.limits.max_concurrent = 2
    o.filters.post_batch = ()
    orch = make_orchestrator(cfg, client=FakeClient(tokenizer), tokenizer=tokenizer, run_dir=tmp_path / "run")
    slow = orch.buffer.envs["slow"]
    steps = 4

    async def main():
        running = asyncio.ensure_future(orch.run(steps))
        try:
            async with asyncio.timeout(30):
                history = await running
            pool = orch.dispatch.pool
            return history, sorted(t.env for t in pool.running.values()), pool.total
        finally:
            slow.env.gate.set()
            if not running.done():
                running.cancel()
            await orch.dispatch.stop()

    history, in_flight, total = asyncio.run(main())
    assert len(history) == steps
    assert in_flight.count("slow") <= 1
    assert sum(m["samples/count"] for m in history) >= steps * 4
    assert total["dispatched"] >= steps * 2 + 1  # the fast env's groups went on being dispatched
