"""Environment work in worker processes (`orchestrator.env_workers.num > 0`, or -1 = auto for an env that declares
itself `cpu_heavy`: `workers_for`): a CPU-heavy reward or a slow tool never stalls the orchestrator's event loop
(every request, timer and weight poll shares it).

`WorkerEnv` stands in for the env in the orchestrator: examples come from the env loaded in process (they are
deterministic per index, docs: primejax/envs/base.py), while `tools`, `env_response`, `score` and a
`drives_rollout` env's whole episode (task setup, tool calls, stop hooks, scoring) run in one of N worker
processes (primejax/envs/env_worker.py: the protocol, plain JSON lines, nothing pickled). A rollout stays on the
worker its first call went to (its live state, e.g. a verifiers world, lives there); new rollouts go to the
worker with the fewest calls in flight. Model calls of an episode come back to the orchestrator, which makes
them as in process (rendering, the request limit, trajectory steps, the policy version per turn).

Timeouts (`orchestrator.env_timeout_s`) hold as in process: the generator bounds `tools` / `env_response` /
`score`, and a worker runs an episode under its own env clock (tool and model calls pause it). Env code that
blocks a worker's loop (a reward stuck in a C call, an endless loop) cannot be cancelled there: the parent pings
every worker and one that has not answered for `env_timeout_s` is hung: it is killed, each rollout it held
errors in one line (counted under its stage), and a fresh worker replaces it.

Envs that sample through their own client (`samples_itself`: verifiers' own loop, already a harness process per
rollout) stay in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import sys
import time
from typing import Any

from primejax.envs import env_clock
from primejax.envs.base import Environment, Example, Message, ModelCall
from primejax.envs.env_worker import jsonable

log = logging.getLogger(__name__)

#: Longest JSON line either side writes (a long conversation with tool outputs); asyncio's default is 64 KiB.
LINE_LIMIT = 1 << 28
#: Where an example handed out by a `WorkerEnv` notes its index.
INDEX_KEY = "env_worker_index"


class EnvWorkerError(RuntimeError):
    """A worker failed the call: it exited, was found hung and replaced, or its env raised."""


class _Proc:
    """One worker process and the calls it runs."""

    def __init__(self, number: int, proc: asyncio.subprocess.Process):
        self.number, self.proc, self.pid = number, proc, proc.pid
        self.calls: dict[int, asyncio.Queue] = {}  # call id -> inbound messages
        self.last_answer = time.monotonic()
        self.dead: str | None = None
        self.reader: asyncio.Task | None = None
        self.pinger: asyncio.Task | None = None

    def send(self, obj: dict[str, Any]) -> None:
        if self.dead is None and self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())


class WorkerPool:
    """N worker processes for one env (`env_id`, `args` as `orchestrator.envs` gives them)."""

    def __init__(self, env_id: str, args: dict[str, Any], num: int, env_timeout_s: float, name: str = ""):
        self.env_id, self.args, self.num, self.env_timeout_s = env_id, dict(args), num, env_timeout_s
        self.name = name or env_id
        self.procs: list[_Proc] = []
        self.replaced = 0  # workers found hung or dead and replaced (since start)
        self.bad_lines = 0  # lines from workers that were not JSON objects (skipped)
        self._numbers = itertools.count()
        self._ids = itertools.count()
        self._started: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._closed = False
        self._replacing: set[asyncio.Future] = set()

    async def start(self) -> None:
        """Start every worker and wait until each has loaded the env (a bad env fails here, one line)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        procs = await asyncio.gather(*(self._spawn() for _ in range(self.num)))
        self.procs.extend(procs)
        self._ready.set()

    async def _spawn(self) -> _Proc:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "primejax.envs.env_worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=LINE_LIMIT,
        )  # fmt: skip
        p = _Proc(next(self._numbers), proc)
        init = {"env_id": self.env_id, "args": self.args, "env_timeout_s": self.env_timeout_s,
                "sys_path": [s or os.getcwd() for s in sys.path]}  # fmt: skip
        proc.stdin.write((json.dumps(init) + "\n").encode())
        line = await proc.stdout.readline()
        try:
            first = json.loads(line) if line else {"fatal": f"exited with code {await proc.wait()}"}
        except json.JSONDecodeError:
            first = {"fatal": f"wrote {line[:200]!r}"}
        if "ready" not in first:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise EnvWorkerError(f"env worker for {self.name!r} could not load the env: {first.get('fatal')}")
        p.last_answer = time.monotonic()  # loading the env (imports) is not a hang
        p.reader = asyncio.ensure_future(self._read(p))
        p.pinger = asyncio.ensure_future(self._ping(p))
        log.info("env worker %d for %r started (pid %d)", p.number, self.name, p.pid)
        return p

    async def _read(self, p: _Proc) -> None:
        """Route the worker's answers to their calls. A line that is not a JSON object is skipped and counted
        (`bad_lines`); should reading fail anyway, the worker is replaced so no call waits on a dead reader."""
        try:
            stdout = p.proc.stdout
            while line := await stdout.readline():
                p.last_answer = time.monotonic()
                try:
                    msg = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    msg = None
                if not isinstance(msg, dict):
                    self.bad_lines += 1
                    log.warning("env worker %d (pid %d): a line that is not a JSON object ignored: %.200r",
                                p.number, p.pid, line)  # fmt: skip
                    continue
                if "pong" in msg:
                    continue
                queue = p.calls.get(msg.get("id"))
                if queue is not None:
                    queue.put_nowait(msg)
            rc = await p.proc.wait()
        except Exception as e:  # noqa: BLE001 - a reader that died must not leave its calls waiting
            self._retire(p, f"env worker {p.number} (pid {p.pid}): reading its answers failed "
                            f"({type(e).__name__}: {e}); killed and replaced")  # fmt: skip
            return
        self._retire(p, p.dead or f"env worker {p.number} (pid {p.pid}) exited with code {rc}")

    async def _ping(self, p: _Proc) -> None:
        """Liveness: a worker whose loop has answered nothing (not even a ping) for env_timeout_s is hung.

        Only time this loop was awake to read counts as the worker's silence: while the orchestrator's own loop
        stalls (a long render, a collection), the worker's answers wait unread in the pipe, and the first look
        after the stall would otherwise blame the worker. So each look adds at most two intervals."""
        interval = min(1.0, self.env_timeout_s / 4)
        silent, seen, looked = 0.0, p.last_answer, time.monotonic()
        while p.dead is None:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if p.last_answer != seen:
                silent, seen = 0.0, p.last_answer
            else:
                silent += min(now - looked, 2 * interval)
            looked = now
            if silent > self.env_timeout_s:
                self._retire(p, f"env worker {p.number} (pid {p.pid}) hung: no answer for {silent:.1f} s "
                                "(orchestrator.env_timeout_s); killed and replaced")  # fmt: skip
                return
            p.send({"op": "ping", "id": next(self._ids)})

    def _retire(self, p: _Proc, reason: str) -> None:
        """Take a dead or hung worker out: its calls fail with `reason`, a fresh one replaces it."""
        if p not in self.procs:
            return
        p.dead = reason
        self.procs.remove(p)
        with contextlib.suppress(ProcessLookupError):
            p.proc.kill()
        for queue in p.calls.values():
            queue.put_nowait({"error": reason, "worker_lost": True})
        p.calls.clear()
        if p.pinger is not None and p.pinger is not asyncio.current_task():
            p.pinger.cancel()
        if self._closed:
            return
        log.warning("%s", reason)
        self.replaced += 1
        task = asyncio.ensure_future(self._replace())
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _replace(self) -> None:
        try:
            p = await self._spawn()
        except Exception as e:  # noqa: BLE001 - logged; the pool goes on with the workers it has
            log.error("env worker for %r could not be replaced: %s", self.name, e)
            return
        if self._closed:  # closed while it started: stop it and its reader and pinger too
            p.dead = "closed"
            for task in (p.reader, p.pinger):
                task.cancel()
            with contextlib.suppress(ProcessLookupError):
                p.proc.kill()
            await p.proc.wait()
            return
        self.procs.append(p)
        self._ready.set()

    async def settled(self) -> None:
        """Wait until every replacement under way has started (or failed)."""
        while self._replacing:
            await asyncio.gather(*self._replacing, return_exceptions=True)

    async def pick(self) -> _Proc:
        """The live worker with the fewest calls in flight (waits while every worker is being replaced)."""
        await self.start()
        while not self.procs:
            self._ready.clear()
            await self._ready.wait()
        return min(self.procs, key=lambda p: len(p.calls))

    async def call(self, p: _Proc, msg: dict[str, Any], on_model: Any = None) -> dict[str, Any]:
        """Send a call and await its answer; `on_model(request) -> reply dict` answers the episode's model calls
        (awaited in the caller's task, so its context, e.g. the group's trace and sticky server, applies)."""
        if p.dead is not None:
            raise EnvWorkerError(f"{p.dead} (it held this rollout's state)")
        n = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        p.calls[n] = queue
        p.send({**msg, "op": "call", "id": n})
        try:
            while True:
                answer = await queue.get()
                if "model" in answer:
                    reply = await on_model(answer)
                    p.send({"op": "reply", "id": n, "call": answer["model"], **reply})
                    continue
                if "error" in answer:
                    raise EnvWorkerError(answer["error"])
                return answer
        except BaseException:
            if (
                p.calls.pop(n, None) is not None
            ):  # still running there: stop it (a hung one is caught by _ping)
                p.send({"op": "cancel", "id": n})
            raise
        finally:
            p.calls.pop(n, None)

    async def aclose(self) -> None:
        self._closed = True
        for p in list(self.procs):
            p.dead = "closed"
            for task in (p.reader, p.pinger):
                if task is not None:
                    task.cancel()
            if p.proc.stdin is not None:
                p.proc.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                p.proc.kill()
            await p.proc.wait()
        self.procs.clear()


class WorkerEnv(Environment):
    """The orchestrator's view of an env whose code runs in a `WorkerPool` (module docstring)."""

    def __init__(self, local: Environment, pool: WorkerPool):
        self.local, self.pool = local, pool
        self.num_examples, self.max_turns = local.num_examples, local.max_turns
        self.drives_rollout, self.samples_itself = local.drives_rollout, False
        self._tools: dict[int, Any] = {}
        self._rollouts: dict[int, tuple[str, _Proc]] = {}  # id(state) -> (rollout id, its worker)
        self._rids = itertools.count()
        self._replaced_seen = 0

    def example(self, index: int) -> Example:
        """The env's example, stamped with its index: a worker rebuilds it from the index alone."""
        example = self.local.example(index)
        return dataclasses.replace(example, info={**example.info, INDEX_KEY: index})

    def _index(self, example: Example) -> int:
        index = example.info.get(INDEX_KEY)
        if index is None:
            raise ValueError(f"an example not made by this env's example() (no info[{INDEX_KEY!r}])")
        return index

    async def _call(self, method: str, example: Example, state: dict[str, Any], messages: Any = None,
                    on_model: Any = None) -> Any:  # fmt: skip
        key = id(state)
        if key not in self._rollouts:
            self._rollouts[key] = (f"r{next(self._rids)}", await self.pool.pick())
        rid, p = self._rollouts[key]
        answer = await self.pool.call(p, {"rid": rid, "method": method, "index": self._index(example),
                                          "messages": messages, "state": jsonable(state)}, on_model)  # fmt: skip
        state.update(answer.get("state") or {})
        return answer.get("result")

    async def tools(self, example: Example) -> list[dict[str, Any]] | None:
        if type(self.local).tools is Environment.tools:  # the base class's: no tools, no round trip
            return None
        index = self._index(example)
        if index not in self._tools:
            scratch: dict[str, Any] = {}
            try:
                self._tools[index] = await self._call("tools", example, scratch)
            finally:
                self.forget(scratch)
        return self._tools[index]

    async def env_response(self, example: Example, messages: list[Message], state: dict[str, Any]) -> Any:
        if type(self.local).env_response is Environment.env_response:
            return None
        return await self._call("env_response", example, state, messages)

    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        try:
            return await self._call("score", example, state, messages)
        finally:
            self._rollouts.pop(id(state), None)  # the worker dropped it after scoring

    async def rollout(self, example: Example, state: dict[str, Any], model: ModelCall) -> list[Message]:
        async def on_model(request: dict[str, Any]) -> dict[str, Any]:
            message = await model(
                request["messages"], request.get("tools"), trainable=request.get("trainable", True)
            )
            return {"message": message, "state": jsonable(state)}

        # The worker runs the episode under its own env clock; ours waits (a blocked worker is caught by the
        # pool's liveness check, docstring).
        with env_clock.paused():
            return await self._call("rollout", example, state, None, on_model)

    def take_replaced(self) -> int:
        """Workers replaced (hung or dead) since the last call: `env_workers/replaced` per step."""
        seen, self._replaced_seen = self._replaced_seen, self.pool.replaced
        return self.pool.replaced - seen

    def forget(self, state: dict[str, Any]) -> None:
        """The rollout owning `state` is over (scored, errored or cancelled): its worker drops its live state."""
        held = self._rollouts.pop(id(state), None)
        if held is not None:
            held[1].send({"op": "release", "rid": held[0]})

    async def aclose(self) -> None:
        await self.pool.aclose()
        await self.local.aclose()


#: The most workers the auto rule gives one env: past a handful, env code is rarely what bounds a step.
AUTO_MAX_WORKERS = 8


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, e.g. under taskset or a cgroup)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def workers_for(env: Environment, num: int, cpus: int | None = None) -> int:
    """Worker processes for `env` under `orchestrator.env_workers.num`: itself when >= 0; -1 (auto) gives a
    `cpu_heavy` env a quarter of the usable CPUs (the trainer and the servers share the node), at least 1 and
    at most AUTO_MAX_WORKERS, and runs any other env in process (a worker costs a process start and a JSON
    round trip per call, more than a cheap reward takes)."""
    if num >= 0:
        return num
    if not env.cpu_heavy:
        return 0
    return max(1, min(AUTO_MAX_WORKERS, (usable_cpus() if cpus is None else cpus) // 4))


def in_workers(env: Environment, env_id: str, args: dict[str, Any], num: int, env_timeout_s: float,
               name: str = "") -> Environment:  # fmt: skip
    """`env` run in `workers_for(env, num)` worker processes, or `env` itself (0 of them, or an env that samples
    itself)."""
    auto, num = num < 0, workers_for(env, num)
    if num <= 0 or env.samples_itself:
        return env
    if auto:
        log.info(
            "env %r declares itself CPU-heavy: %d env worker processes (env_workers.num = -1, auto; %d usable "
            "CPUs)",
            name or env_id,
            num,
            usable_cpus(),
        )
    return WorkerEnv(env, WorkerPool(env_id, args, num, env_timeout_s, name))
