"""verifiers environments through verifiers' own env server (primejax/envs/env_server.py): a local server the
orchestrator starts and remote ones at addresses, driven by a scripted model behind vLLM's token-in/token-out
route (tests/envs/instant_model.py); the samples are the ids the server answered, a killed server's rollout
errors at once and is counted, the next rollouts run on a live (or restarted) server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from primejax.envs.env_server import EnvServerError, VerifiersServerEnv
from primejax.envs.registry import load_env
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.renderer import build_renderer, load_tokenizer
from tests.envs.instant_model import InstantModel, InstantServer

TASKSET = "tests.envs.vf_calc_taskset"


class Version:
    version = 3


class Scorer:
    async def finalize_rollout(self, rollout):
        rollout.assign_advantages(1.0)


class Signalling(InstantModel):
    """Sets `called` on each model call: the test kills a server while its rollout is mid-episode."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.called = asyncio.Event()

    def reply(self, prompt_token_ids):
        self.called.set()
        return super().reply(prompt_token_ids)


def _generator(server, renderer):
    return GroupGenerator(server, renderer, SamplingConfig(max_tokens=64, max_turns=4), Version(), max_concurrent=4,
                          max_prompt_tokens=4096)  # fmt: skip


def _check_ok(rollout, served):
    assert rollout.error is None, rollout.error
    assert [m["role"] for m in rollout.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert rollout.reward == 1.0 and rollout.state["reward_components"] == {"correct": 1.0}
    # every step is one request the model server answered, with its logprobs, tagged with the start version
    steps = [(s.prompt_ids, s.completion_ids) for s in rollout.steps]
    assert steps and all(step in served for step in steps)
    assert all(s.completion_logprobs == [-0.1] * len(s.completion_ids) for s in rollout.steps)
    assert {s.policy_version for s in rollout.steps} == {3}


def test_args_are_checked_with_one_line():
    with pytest.raises(ValueError, match=r"args.servers must be a list of ZMQ addresses"):
        load_env(TASKSET, {"size": 2, "driver": "env_server", "servers": "tcp://127.0.0.1:5000"})
    with pytest.raises(ValueError, match=r"args.server_workers must be >= 1"):
        load_env(TASKSET, {"size": 2, "driver": "env_server", "server_workers": 0})


def test_a_local_env_server_runs_rollouts_and_a_killed_one_is_survived(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    renderer = build_renderer("auto", tokenizer)
    env = load_env(TASKSET, {"size": 4, "driver": "env_server", "server_timeout_s": 20})
    assert isinstance(env, VerifiersServerEnv) and env.servers.local

    async def main():
        model = Signalling(tokenizer)
        async with InstantServer(model, str(tiny_model_dir)) as server:
            gen = _generator(server, renderer)
            slot = EnvSlot(name="calc", env=env, weight=1.0, algorithm=Scorer())
            try:
                (first,) = await gen.group(slot, 1, 0, 1, step=1)
                _check_ok(first, server.served)
                (conn,) = env.servers.conns
                # kill the server while a rollout runs on it (its first model call answered)
                model.called.clear()
                running = asyncio.ensure_future(gen.group(slot, 1, 1, 1, step=2))
                await model.called.wait()
                os.kill(conn.proc.pid, signal.SIGKILL)
                (lost,) = await running
                # the next rollout runs on the server started in its place
                (after,) = await gen.group(slot, 1, 2, 1, step=3)
                return first, lost, after, conn, env.servers
            finally:
                await env.aclose()

    first, lost, after, dead, servers = asyncio.run(main())
    assert lost.error is not None and f"env server {dead.address}" in lost.error and "exited" in lost.error
    assert servers.lost == 1 and servers.replaced == 1
    assert after.error is None, after.error
    assert servers.conns[0].address != dead.address
