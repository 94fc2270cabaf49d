"""verifiers environments through verifiers' own env server (`verifiers.v1.serve`): local and remote.

`args.driver = "env_server"` runs a verifiers taskset's rollouts in verifiers' `EnvServer` (a ZMQ ROUTER speaking
msgpack; verifiers' `EnvClient` is the client), so an environment runs under primejax exactly as under `vf-eval`
and prime-rl: the server drives each episode with verifiers' own loop (a harness program, verifiers'
interception server, the train client sampling from primejax's vLLM server through `/inference/v1/generate`),
and the episode's traces come back with every call's prompt and completion ids and sampling logprobs, which
become trajectory steps exactly as for `args.driver = "verifiers"` (primejax/envs/verifiers_loop.py: the same
conversion, the same losses against the in-process driver).

Where the servers are:
- local (`args.servers` empty): `args.server_workers` server processes started on first use, each
  `python -m primejax.envs.env_server` bound to an OS-chosen port on 127.0.0.1, sized by config; they exit when
  the orchestrator does (their stdin is a lifeline) and one that dies is started again;
- remote (`args.servers = ["tcp://host:port", ...]`): servers someone started elsewhere with the same command
  (`python -m primejax.envs.env_server --env <id> --args '<json>' --address tcp://0.0.0.0:5000`), each
  with its own address; their vLLM base URL must be reachable from there.

Health: every server answers verifiers' `health` request; one silent for `args.server_timeout_s` (or a local
one whose process exited) is down: the rollouts in flight on it error at once, naming it, and are counted
(`lost`); new rollouts go to the live servers (the fewest in flight). A remote server that answers again is up
again (ZMQ reconnects by itself; `reconnected` counts it); a local one is replaced by a fresh process. With no
server up, a rollout waits `args.server_timeout_s` for one and then errors.

The env's examples are loaded here too (the orchestrator samples them); a rollout ships its task's data
(`TaskData`, as verifiers' client does), never the example index.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from primejax.envs.base import Endpoint, Example, SampledRollout
from primejax.envs.verifiers_loop import (
    DEFAULT_HARNESS,
    VerifiersLoopEnv,
    _shipped_harness,
    episode_to_rollout,
    model_context,
)
from primejax.envs.verifiers_loop import load as load_verifiers

log = logging.getLogger(__name__)

#: A local server's first line on stdout names its bound address; it has this long to load the env (imports).
STARTUP_TIMEOUT_S = 180.0


class EnvServerError(RuntimeError):
    """A rollout lost to its env server (down, or none up)."""


class _Conn:
    """One connection to one server process; a replaced local server is a new `_Conn`."""

    def __init__(self, address: str, proc: asyncio.subprocess.Process | None = None):
        from verifiers.v1.serve import EnvClient

        self.address, self.proc = address, proc
        self.client = EnvClient(address)
        self.down = asyncio.Event()  # set once: the rollouts in flight on it fail
        self.reason = ""
        self.in_flight = 0

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.close()
        if self.proc is not None and self.proc.returncode is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the lifeline: the server ends itself (its harness programs too)
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()


class EnvServers:
    """The env servers of one environment: started (local) or reached (remote), watched, picked per rollout."""

    def __init__(self, env_id: str, args: dict[str, Any], *, addresses: list[str], workers: int,
                 timeout_s: float, max_concurrent: int = 0, name: str = ""):  # fmt: skip
        self.env_id, self.args, self.name = env_id, dict(args), name or env_id
        self.addresses, self.workers = list(addresses), workers
        self.timeout_s, self.max_concurrent = timeout_s, max_concurrent
        self.conns: list[_Conn | None] = []
        self.lost = 0  # rollouts errored because their server went down
        self.reconnected = 0  # remote servers that answered again after being down
        self.replaced = 0  # local servers started again after dying
        self._seen = {"lost": 0, "replaced": 0, "reconnected": 0}  # as of the last take_counts()
        self._watchers: list[asyncio.Task] = []
        self._started: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._closed = False

    @property
    def local(self) -> bool:
        return not self.addresses

    async def start(self, max_turns: int, env_timeout_s: float | None) -> None:
        """Start (local) or reach (remote) the servers, once; later calls wait for the first."""
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            raise RuntimeError(f"env {self.name!r}: its env servers belong to another event loop")
        if self._started is None:
            self._loop = loop
            self._started = asyncio.ensure_future(self._start(max_turns, env_timeout_s))
        await asyncio.shield(self._started)

    async def _start(self, max_turns: int, env_timeout_s: float | None) -> None:
        self._spawn_args = (max_turns, env_timeout_s)
        if self.local:
            self.conns = list(await asyncio.gather(*(self._spawn() for _ in range(self.workers))))
        else:
            self.conns = [_Conn(a) for a in self.addresses]
            ups = await asyncio.gather(*(self._healthy(c) for c in self.conns))
            for conn, up in zip(self.conns, ups, strict=True):
                if not up:
                    self._mark_down(conn, f"env server {conn.address} did not answer at start")
            if not any(ups):
                raise EnvServerError(
                    f"env {self.name!r}: no env server answered ({', '.join(self.addresses)})"
                )
        self._watchers += [asyncio.ensure_future(self._watch(i)) for i in range(len(self.conns))]

    async def _spawn(self) -> _Conn:
        max_turns, env_timeout_s = self._spawn_args
        cmd = [sys.executable, "-m", "primejax.envs.env_server", "--env", self.env_id,
               "--args", json.dumps(self.args), "--address", "tcp://127.0.0.1:0", "--lifeline",
               "--max-turns", str(max_turns), "--max-concurrent", str(self.max_concurrent),
               "--sys-path", json.dumps([s or os.getcwd() for s in sys.path])]  # fmt: skip
        if env_timeout_s is not None:
            cmd += ["--env-timeout-s", str(env_timeout_s)]
        proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE)  # fmt: skip
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), STARTUP_TIMEOUT_S)
            first = json.loads(line) if line else {}
        except (TimeoutError, json.JSONDecodeError):
            first = {}
        if "address" not in first:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            rc = await proc.wait()
            raise EnvServerError(
                f"env server for {self.name!r} did not start (exit code {rc}; its stderr says why)"
            )
        log.info("env server for %r up at %s (pid %d)", self.name, first["address"], proc.pid)
        conn = _Conn(first["address"], proc)
        self._watch_exit(conn)
        return conn

    async def _healthy(self, conn: _Conn, timeout_s: float | None = None) -> bool:
        timeout_s = timeout_s or self.timeout_s
        try:  # the send itself may wait while the peer is gone: bound the whole request
            return await asyncio.wait_for(conn.client.health(timeout=timeout_s), timeout_s)
        except (TimeoutError, RuntimeError):
            return False

    def _watch_exit(self, conn: _Conn) -> None:
        """A local server's exit marks it down at once (not after `timeout_s` of silence)."""

        async def wait() -> None:
            rc = await conn.proc.wait()
            if not self._closed:
                self._mark_down(
                    conn, f"env server {conn.address} (pid {conn.proc.pid}) exited with code {rc}"
                )

        task = asyncio.ensure_future(wait())
        self._watchers.append(task)

    def _mark_down(self, conn: _Conn, reason: str) -> None:
        if conn.down.is_set():
            return
        conn.reason = reason
        conn.down.set()
        log.warning("%s", reason)
        self._changed.set()

    async def _watch(self, i: int) -> None:
        """Health of server i: down after `timeout_s` of silence (or its process exiting); a remote one that
        answers again is up again, a local one is replaced."""
        interval = min(1.0, self.timeout_s / 4)
        last_ok = time.monotonic()
        while not self._closed:
            conn = self.conns[i]
            if conn.down.is_set() and conn.proc is not None:
                pass  # a local server that exited (_watch_exit): replaced below
            elif await self._healthy(conn, min(self.timeout_s, 2.0)):
                last_ok = time.monotonic()
                if conn.down.is_set() and conn.proc is None:  # remote: reachable again, on a fresh connection
                    await conn.close()
                    self.conns[i] = conn = _Conn(conn.address)
                    self.reconnected += 1
                    log.warning("env server %s answers again", conn.address)
                    self._changed.set()
            elif time.monotonic() - last_ok > self.timeout_s:
                self._mark_down(conn, f"env server {conn.address} silent for {self.timeout_s:.0f} s "
                                      "(args.server_timeout_s)")  # fmt: skip
            if conn.down.is_set() and conn.proc is not None and not self._closed:
                await conn.close()
                try:
                    self.conns[i] = await self._spawn()
                    self.replaced += 1
                    self._changed.set()
                    last_ok = time.monotonic()
                    continue
                except EnvServerError as e:  # it could not start: try again after a while, not in a loop
                    log.error("%s", e)
                    await asyncio.sleep(self.timeout_s)
            await asyncio.sleep(interval)

    async def pick(self) -> _Conn:
        """The live server with the fewest rollouts in flight; waits up to `timeout_s` while none is up."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            live = [c for c in self.conns if c is not None and not c.down.is_set()]
            if live:
                return min(live, key=lambda c: c.in_flight)
            left = deadline - time.monotonic()
            if left <= 0:
                raise EnvServerError(f"env {self.name!r}: no env server is up")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def run(self, ctx: Any, task_data: dict[str, Any]) -> Any:
        """One episode on a live server; fails at once (EnvServerError, counted in `lost`) if that server goes
        down before it answers."""
        conn = await self.pick()
        conn.in_flight += 1
        running = asyncio.ensure_future(conn.client.run(ctx.client, ctx.model, ctx.sampling, task_data))
        down = asyncio.ensure_future(conn.down.wait())
        try:
            await asyncio.wait({running, down}, return_when=asyncio.FIRST_COMPLETED)
            if running.done():
                return running.result()
            self.lost += 1
            raise EnvServerError(f"{conn.reason} (this rollout ran there)")
        finally:
            conn.in_flight -= 1
            down.cancel()
            if not running.done():
                running.cancel()  # verifiers' client asks the server to abort the episode
                running.add_done_callback(lambda t: t.cancelled() or t.exception())

    def take_counts(self) -> dict[str, float]:
        """Rollouts lost, servers replaced and reconnected since the last call (`env_servers/*` per step)."""
        now = {"lost": self.lost, "replaced": self.replaced, "reconnected": self.reconnected}
        seen, self._seen = self._seen, now
        return {f"env_servers/{k}": float(v - seen[k]) for k, v in now.items()}

    async def aclose(self) -> None:
        self._closed = True
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for conn in self.conns:
            if conn is not None:
                await conn.close()


class VerifiersServerEnv(VerifiersLoopEnv):
    """A verifiers taskset whose rollouts run on verifiers' env servers (module docstring)."""

    @classmethod
    def from_args(cls, taskset_id: str, *, servers: list[str] | tuple[str, ...] = (), server_workers: int = 1,
                  server_timeout_s: float = 30.0, server_max_concurrent: int = 0, harness: str = "",
                  harness_args: dict[str, Any] | None = None, runtime: str = "subprocess",
                  **args: Any) -> VerifiersServerEnv:  # fmt: skip
        from primejax.envs.verifiers_adapter import VerifiersEnv

        where = f"verifiers env {taskset_id!r}"
        if isinstance(servers, str) or not all(isinstance(a, str) and "://" in a for a in servers):
            raise ValueError(f"{where}: args.servers must be a list of ZMQ addresses like 'tcp://host:5000'")
        if server_workers < 1 or server_timeout_s <= 0 or server_max_concurrent < 0:
            raise ValueError(f"{where}: args.server_workers must be >= 1, args.server_timeout_s > 0, "
                             "args.server_max_concurrent >= 0")  # fmt: skip
        env = VerifiersEnv(taskset_id, **args)
        chosen = harness or _shipped_harness(taskset_id) or DEFAULT_HARNESS
        self = cls.wrap(env, harness=chosen, harness_args=harness_args or {}, runtime=runtime,
                        local=not servers)  # fmt: skip
        # What a local server loads: this env, driven by verifiers' own loop there.
        served = {**args, "driver": "verifiers", "harness": chosen, "harness_args": harness_args or {},
                  "runtime": runtime}  # fmt: skip
        self.servers = EnvServers(taskset_id, served, addresses=list(servers), workers=server_workers,
                                  timeout_s=server_timeout_s, max_concurrent=server_max_concurrent)  # fmt: skip
        return self

    @classmethod
    def wrap(cls, env: Any, *, harness: str, harness_args: dict[str, Any], runtime: str,
             local: bool = True) -> VerifiersServerEnv:  # fmt: skip
        if local:  # the servers run here: check uv, the harness and the runtime now, one line each
            return super().wrap(env, harness=harness, harness_args=harness_args, runtime=runtime)
        self = cls.__new__(cls)  # remote: the servers hold the harness and runtime
        self.__dict__.update(env.__dict__)
        self.harness, self.harness_args, self.runtime = harness, dict(harness_args), runtime
        self._loop_envs, self._serving, self._lock = {}, {}, None
        return self

    async def sample_rollout(
        self, example: Example, state: dict[str, Any], endpoint: Endpoint
    ) -> SampledRollout:
        await self.servers.start(endpoint.max_turns, endpoint.env_timeout_s)
        index = example.info["index"]
        episode = await self.servers.run(
            model_context(endpoint), self.tasks[index].data.model_dump(mode="json")
        )
        return episode_to_rollout(
            episode, getattr(self, "policy_agents", []), state, getattr(self, "seats", []), index
        )

    async def aclose(self) -> None:
        await self.servers.aclose()
        await super().aclose()


def load(taskset_id: str, **args: Any) -> VerifiersServerEnv:
    return VerifiersServerEnv.from_args(taskset_id, **args)


# ---- the server process ---------------------------------------------------------------------------------------


def _lifeline() -> None:
    """End this server when its parent closes our stdin (or dies): SIGTERM ourselves, which asyncio.run turns
    into a clean teardown of verifiers' serving resources (below)."""

    def watch() -> None:
        with contextlib.suppress(Exception):
            while sys.stdin.buffer.read(4096):
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


def _on_sigterm(*_: Any) -> None:
    """SIGTERM ends asyncio.run with its cleanup (verifiers' serving resources, harness programs); once only: a
    second SIGTERM (the lifeline's and the parent's) must not interrupt that cleanup."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m primejax.envs.env_server",
        description="Serve one verifiers environment with verifiers' EnvServer.",
    )
    p.add_argument("--env", required=True, help="the taskset id (as orchestrator.envs.<name>.id)")
    p.add_argument("--args", default="{}", help="the env's args as JSON (as orchestrator.envs.<name>.args)")
    p.add_argument("--address", default="tcp://127.0.0.1:5000", help="ZMQ address to bind (port 0: any)")
    p.add_argument("--max-turns", type=int, default=0, help="model calls per episode (0: the env's own)")
    p.add_argument(
        "--env-timeout-s", type=float, default=None, help="deadline of the env's setup/scoring stages"
    )
    p.add_argument(
        "--max-concurrent", type=int, default=0, help="episodes in flight on this server (0: no cap)"
    )
    p.add_argument("--lifeline", action="store_true", help="exit when stdin closes (a parent started us)")
    p.add_argument(
        "--sys-path", default="", help=argparse.SUPPRESS
    )  # the parent's import path (test tasksets)
    a = p.parse_args(argv)
    if a.sys_path:
        sys.path[:] = json.loads(a.sys_path)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s env_server %(levelname)s %(message)s")
    if a.lifeline:
        _lifeline()
    signal.signal(signal.SIGTERM, _on_sigterm)
    from verifiers.v1.serve import EnvServer

    try:
        args = json.loads(a.args)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--args is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise SystemExit("--args must be a JSON object")
    env = load_verifiers(a.env, **{**args, "driver": "verifiers"})
    vf_env = env._build(a.max_turns or env.max_turns, a.env_timeout_s)
    server = EnvServer(config=vf_env.config, address=a.address, max_concurrent=a.max_concurrent or None)
    print(json.dumps({"address": server.address}), flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(server.run())


if __name__ == "__main__":
    main()
