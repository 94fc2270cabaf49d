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
from primejax.rendering.renderer import build_renderer, load_tokenizer
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


@pytest.mark.slow  # a server process and three harness rollouts (~40 s on 2 cores); test_env_server_run.py stands for it
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
    counts = {"env_servers/lost": 1.0, "env_servers/replaced": 1.0, "env_servers/reconnected": 0.0}
    assert servers.take_counts() == counts and set(servers.take_counts().values()) == {0.0}  # per step
    assert after.error is None, after.error
    assert servers.conns[0].address != dead.address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int) -> subprocess.Popen:
    """A "remote" env server: another process with its own address, started as a user would start one."""
    proc = subprocess.Popen([sys.executable, "-m", "primejax.envs.env_server", "--env", TASKSET,
                             "--args", json.dumps({"size": 4}), "--address", f"tcp://127.0.0.1:{port}"],
                            stdout=subprocess.PIPE)  # fmt: skip
    assert json.loads(proc.stdout.readline()) == {"address": f"tcp://127.0.0.1:{port}"}
    return proc


def test_no_remote_server_answering_is_one_line():
    env = load_env(TASKSET, {"size": 2, "driver": "env_server", "server_timeout_s": 0.5,
                             "servers": [f"tcp://127.0.0.1:{_free_port()}"]})  # fmt: skip

    async def main():
        try:
            await env.servers.start(4, None)
        finally:
            await env.aclose()

    with pytest.raises(EnvServerError, match=r"no env server answered \(tcp://127.0.0.1:\d+\)$"):
        asyncio.run(main())


@pytest.mark.slow  # two server processes and five harness rollouts (~140 s on 2 cores); test_env_server_run.py stands for it
def test_remote_env_servers_a_killed_one_errors_its_rollout_and_reconnects(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    renderer = build_renderer("auto", tokenizer)
    ports = [_free_port(), _free_port()]
    procs = [_serve(p) for p in ports]
    addresses = [f"tcp://127.0.0.1:{p}" for p in ports]
    env = load_env(TASKSET, {"size": 4, "driver": "env_server", "servers": addresses, "server_timeout_s": 3})

    async def main():
        model = Signalling(tokenizer)
        async with InstantServer(model, str(tiny_model_dir)) as server:
            gen = _generator(server, renderer)
            slot = EnvSlot(name="calc", env=env, weight=1.0, algorithm=Scorer())
            try:
                both = await gen.group(slot, 1, 0, 2, step=1)  # one rollout on each server
                for rollout in both:
                    _check_ok(rollout, server.served)
                # the first server dies mid-rollout: the rollout errors once it has been silent 3 s
                model.called.clear()
                running = asyncio.ensure_future(gen.group(slot, 1, 1, 1, step=2))
                await model.called.wait()
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait()
                (lost,) = await running
                (on_second,) = await gen.group(slot, 1, 2, 1, step=3)  # the live one takes the next
                procs[0] = _serve(ports[0])  # the first comes back at its address
                async with asyncio.timeout(60):
                    while env.servers.reconnected == 0:
                        await asyncio.sleep(0.2)
                (back,) = await gen.group(slot, 1, 3, 1, step=4)
                return both, lost, on_second, back, env.servers
            finally:
                await env.aclose()

    try:
        both, lost, on_second, back, servers = asyncio.run(main())
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    assert lost.error is not None and f"env server {addresses[0]} silent for 3 s" in lost.error
    assert servers.lost == 1 and servers.reconnected == 1 and servers.replaced == 0
    assert on_second.error is None and back.error is None, (on_second.error, back.error)
    assert [c.address for c in servers.conns] == addresses and not any(c.down.is_set() for c in servers.conns)
