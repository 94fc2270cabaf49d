"""Environment work in worker processes (orchestrator.env_workers): real worker processes, a scripted stand-in
model (tests/orchestrator/orch_fakes.py FakeClient, no vLLM: what is tested is the env side)."""

from __future__ import annotations

import asyncio
import os

import pytest
from orch_fakes import FakeClient, make_orchestrator, small_config

from primejax.config import env as env_entry
from primejax.contracts.batch import read_batch, step_dir
from primejax.envs.registry import load_env
from primejax.envs.workers import AUTO_MAX_WORKERS, EnvWorkerError, WorkerEnv, in_workers, workers_for
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.rendering.renderer import build_renderer


class Version:
    version = 0


@pytest.mark.parametrize("num", [-1, 2])
def test_a_hung_env_worker_errors_its_rollouts_is_replaced_and_the_pool_refills(tmp_path, tokenizer, num):
    """num -1: the defaults (continuous pool, auto env workers for a CPU-heavy env: one worker on a 2-core box,
    so the hang takes every rollout in flight with it); 2: the other worker goes on meanwhile."""
    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, env_id="worker_envs:load_hang_once", batch_size=8, group_size=4)
    cfg.orchestrator.envs.reverse_text.args = {"marker": str(tmp_path / "hung")}
    if num >= 0:
        cfg.orchestrator.env_workers.num = num
    assert (
        cfg.orchestrator.pool.mode == "continuous" and cfg.orchestrator.env_workers.num == num
    )  # -1: default
    cfg.orchestrator.env_timeout_s = 2.0
    orch = make_orchestrator(cfg, client=FakeClient(tokenizer), tokenizer=tokenizer, run_dir=run_dir)
    env = orch.slots[0].env
    assert isinstance(env, WorkerEnv) and env.pool.num == workers_for(env.local, num)

    async def main():
        try:
            history = await asyncio.wait_for(orch.run(3), 60)
            await asyncio.wait_for(env.pool.settled(), 30)
            return history, [p.pid for p in env.pool.procs]
        finally:
            await orch.close()

    history, pids = asyncio.run(main())
    assert (tmp_path / "hung").exists()  # the hang happened (in a worker: this process went on)
    assert sum(m.get("errors/score", 0) for m in history) >= 1  # its rollout errored, counted
    assert sum(m.get("env_workers/replaced", 0) for m in history) == 1
    assert len(pids) == env.pool.num and os.getpid() not in pids
    assert [m["batch/rollouts"] for m in history] == [8, 8, 8]  # the pool refilled: every batch is full
    for n in (1, 2, 3):
        assert read_batch(step_dir(run_dir, n) / "rank_0.npz").meta["num_samples"] > 0


def test_auto_env_workers_size_cpu_heavy_envs_to_the_machine_and_keep_the_rest_in_process(
    tmp_path, tokenizer
):
    heavy = load_env("worker_envs:load_hang_once", {"marker": str(tmp_path / "unused")})
    light = load_env("reverse-text")
    assert heavy.cpu_heavy and not light.cpu_heavy
    # -1 (auto): a quarter of the usable CPUs for a CPU-heavy env, at least 1, at most AUTO_MAX_WORKERS
    assert [workers_for(heavy, -1, cpus) for cpus in (1, 2, 7, 8, 16, 31, 64, 512)] == [
        1,
        1,
        1,
        2,
        4,
        7,
        8,
        8,
    ]
    assert AUTO_MAX_WORKERS == 8
    assert workers_for(light, -1, 512) == 0  # a cheap env stays in process
    assert workers_for(heavy, 0, 512) == 0 and workers_for(light, 3, 2) == 3  # an explicit number is kept
    # the default config: the CPU-heavy env in worker processes, reverse-text in the orchestrator's process
    cfg = small_config(tmp_path / "run")
    cfg.orchestrator.envs.heavy = env_entry("worker_envs:load_hang_once", marker=str(tmp_path / "unused"))
    orch = make_orchestrator(cfg, client=FakeClient(tokenizer), tokenizer=tokenizer, run_dir=tmp_path / "run")
    envs = {slot.name: slot.env for slot in orch.slots}
    assert isinstance(envs["heavy"], WorkerEnv) and envs["heavy"].pool.num == workers_for(heavy, -1)
    assert not isinstance(envs["reverse_text"], WorkerEnv)
    asyncio.run(orch.close())  # no worker was started (they start with the run)


def _generator(tokenizer, client):
    return GroupGenerator(
        client,
        build_renderer("auto", tokenizer),
        SamplingConfig(max_tokens=16),
        Version(),
        max_concurrent=8,
        max_prompt_tokens=128,
        env_timeout_s=5.0,
    )


def test_an_env_driven_episode_runs_in_a_worker_and_its_model_calls_come_back(tokenizer):
    local = load_env("worker_envs:load_tool_episode")
    env = in_workers(local, "worker_envs:load_tool_episode", {}, 1, 5.0)
    slot = EnvSlot(name="tool", env=env, weight=1.0, algorithm=_Algo())
    gen = _generator(tokenizer, FakeClient(tokenizer, replies=lambda prompt, member: f"ok {member}"))

    async def main():
        try:
            return await gen.group(slot, 3, 0, 2, 1)
        finally:
            await env.aclose()

    rollouts = asyncio.run(main())
    for r in rollouts:
        assert r.error is None, r.error
        assert len(r.steps) == 2  # both model calls made here, with trajectory steps
        assert r.reward == 3.0  # the live counter kept in the worker between rollout and score
        assert r.state["env_pid"] == r.state["score_pid"] != os.getpid()
        assert r.state["seen_output_tokens"] == r.num_completion_tokens  # our state reached the env
        assert "live" not in r.state  # non-JSON state stayed in the worker
        assert f"from {r.state['env_pid']}" in r.messages[2]["content"]
    assert gen.stats.requests == 3  # the group's shared first request, then one each


def test_an_env_that_fails_to_load_in_a_worker_says_so_in_one_line(tokenizer):
    env = in_workers(load_env("reverse-text"), "reverse-text", {"min_len": 0}, 1, 5.0)

    async def main():
        try:
            await env.score(env.example(0), [], {})
        finally:
            await env.aclose()

    with pytest.raises(EnvWorkerError, match="could not load the env: ValueError: reverse-text needs"):
        asyncio.run(main())


def test_a_worker_keeps_the_parents_import_order(tmp_path, monkeypatch, tokenizer):
    """A folder at the end of this process's sys.path stays at the end in the worker. Importing setuptools
    appends its _vendor folder (an older typing_extensions); a worker that put the parent's extra folders first
    imported from it (`cannot import name 'Sentinel' from 'typing_extensions'`). Here a folder appended last holds
    a `difflib` that fails, and the worker's env (reverse-text imports difflib) must still load and score."""
    late = tmp_path / "late"
    late.mkdir()
    (late / "difflib.py").write_text("raise ImportError('the late folder shadowed the standard library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # something of the parent's, in front
    monkeypatch.setattr("sys.path", [*__import__("sys").path, str(late)])
    local = load_env("reverse-text")
    env = in_workers(local, "reverse-text", {}, 1, 10.0)
    ex = env.example(0)
    messages = [{"role": "assistant", "content": ex.answer[::-1]}]

    async def main():
        try:
            return await env.score(ex, messages, {}), await local.score(ex, messages, {})
        finally:
            await env.aclose()

    in_worker, here = asyncio.run(main())
    assert in_worker == here


class _Algo:
    async def finalize_rollout(self, rollout):
        return None


def _scored_by_writer(lines, timeout_s=20.0):
    """One scoring call in a worker whose env writes `lines` into the protocol pipe first: (result or the error
    line, lines skipped, workers replaced)."""
    args = {"lines": lines}
    env = in_workers(load_env("worker_envs:load_protocol_writer", args), "worker_envs:load_protocol_writer", args,
                     1, 10.0)  # fmt: skip
    ex = env.example(0)

    async def main():
        try:
            try:
                result = await asyncio.wait_for(
                    env.score(ex, [{"role": "assistant", "content": "x"}], {}), timeout_s
                )
            except EnvWorkerError as e:
                result = str(e)
            await asyncio.wait_for(env.pool.settled(), 30)
            return result, env.pool.bad_lines, env.pool.replaced, len(env.pool.procs)
        finally:
            await env.aclose()

    return asyncio.run(main())


def test_a_worker_line_that_is_not_a_json_object_is_skipped_and_the_call_answered():
    """Issue 48: `[1, 2]` on the pipe killed the parent's reader for that worker, and every later call waited
    env_timeout_s. Now such lines are skipped and counted; the call's own answer still arrives."""
    result, bad, replaced, live = _scored_by_writer(["[1, 2]", '"pong"', "3", "null", "not json"])
    assert isinstance(result, float), result
    assert (bad, replaced, live) == (5, 0, 1)


def test_a_worker_whose_answers_cannot_be_read_is_replaced(monkeypatch):
    """A line past the reader's limit (asyncio raises in readline): the worker is replaced and its call fails in
    one line instead of waiting forever."""
    monkeypatch.setattr("primejax.envs.workers.LINE_LIMIT", 4096)
    result, bad, replaced, live = _scored_by_writer(["x" * 20_000])
    assert "reading its answers failed" in result and "killed and replaced" in result, result
    assert (replaced, live) == (1, 1)


def test_a_stalled_orchestrator_loop_does_not_make_a_healthy_worker_hung(tokenizer):
    """Issue 48: a stall of the orchestrator's own loop (a long render) left the worker's pongs unread, and the
    first look after it declared the healthy worker hung. Only the loop's waking time counts as silence."""
    import time

    env = in_workers(load_env("reverse-text"), "reverse-text", {}, 1, 2.0)  # env_timeout_s 2 s
    ex = env.example(0)

    async def main():
        try:
            await env.pool.start()
            await env.score(ex, [{"role": "assistant", "content": "x"}], {})  # the worker answers
            time.sleep(
                4.5
            )  # the loop stalls 2.25 x env_timeout_s (by construction: nothing else runs meanwhile)
            result = await asyncio.wait_for(env.score(ex, [{"role": "assistant", "content": "y"}], {}), 10)
            await asyncio.wait_for(
                env.pool.settled(), 30
            )  # a replacement (the bug) finishes before the close
            return result, env.pool.replaced
        finally:
            await env.aclose()

    result, replaced = asyncio.run(main())
    assert isinstance(result, float) and replaced == 0
