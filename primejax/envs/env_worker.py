"""One environment worker process: an env's own code (task setup, tool calls, `env_response`, scoring) off the
orchestrator's event loop. Started by primejax/envs/workers.py as `python -m primejax.envs.env_worker`.

Protocol: one JSON object per line, parent -> worker on stdin, worker -> parent on a private copy of stdout (the
env's own prints go to stderr, so they cannot corrupt it). Nothing is pickled: what crosses is plain JSON.

parent -> worker
- the first line: `{"env_id", "args", "env_timeout_s", "sys_path"}`; the worker loads the env and answers
  `{"ready": pid}` or `{"fatal": "<one line>"}`.
- `{"op": "call", "id", "rid", "method", "index", "messages", "state"}`: run `tools` / `env_response` /
  `score` / `rollout` on the example at `index` (the env's examples are deterministic per index, so the example
  itself never crosses). `rid` names the rollout: its live state dict (a verifiers world, toolset instances)
  stays here between calls; the JSON-able keys of the parent's copy are merged into it at each call.
- `{"op": "reply", "id", "call", "message", "state"}`: the answer to a model call the rollout made.
- `{"op": "cancel", "id"}`, `{"op": "release", "rid"}`, `{"op": "ping", "id"}`.

worker -> parent
- `{"id", "result", "state"}` (the state's JSON-able keys) or `{"id", "error"}`;
- `{"id", "model", "messages", "tools", "trainable"}`: a model call of a `rollout` (a `drives_rollout` env);
- `{"pong": id}`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import threading
from typing import Any

from primejax.envs.env_clock import EnvClock


def jsonable(state: dict[str, Any]) -> dict[str, Any]:
    """The keys of a state dict whose values are plain JSON (a verifiers world or a toolset object stays home)."""
    out = {}
    for key, value in state.items():
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


class Worker:
    def __init__(self, env: Any, env_timeout_s: float, send: Any):
        self.env, self.env_timeout_s, self.send = env, env_timeout_s, send
        self.states: dict[str, dict[str, Any]] = {}
        self.tasks: dict[int, asyncio.Task] = {}
        self.replies: dict[tuple[int, int], asyncio.Future] = {}

    def handle(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "call":
            self.tasks[msg["id"]] = asyncio.create_task(self.call(msg))
        elif op == "reply":
            future = self.replies.pop((msg["id"], msg["call"]), None)
            if future is not None and not future.done():
                future.set_result(msg)
        elif op == "cancel":
            if (task := self.tasks.get(msg["id"])) is not None:
                task.cancel()
        elif op == "release":
            self.states.pop(msg["rid"], None)
        elif op == "ping":
            self.send({"pong": msg["id"]})
        else:
            print(f"env worker {os.getpid()}: unknown op {op!r} ignored", file=sys.stderr)

    async def call(self, msg: dict[str, Any]) -> None:
        n, rid, method = msg["id"], msg["rid"], msg["method"]
        state = self.states.setdefault(rid, {})
        state.update(msg.get("state") or {})
        try:
            example = self.env.example(msg["index"])
            if method == "tools":
                result = await self.env.tools(example)
            elif method == "env_response":
                result = await self.env.env_response(example, msg["messages"], state)
            elif method == "score":
                result = await self.env.score(example, msg["messages"], state)
                self.states.pop(rid, None)  # scoring is a rollout's last call
            elif method == "rollout":
                result = await self._rollout(n, example, state)
            else:
                raise ValueError(f"unknown method {method!r}")
            line = {"id": n, "result": result, "state": jsonable(state)}
            try:
                self.send(line)
            except (TypeError, ValueError) as e:
                raise TypeError(f"the environment's {method} returned data that is not JSON ({e})") from None
        except asyncio.CancelledError:
            self.states.pop(rid, None)
        except Exception as e:  # noqa: BLE001 - the env's failure is its rollout's, reported in one line
            self.send({"id": n, "error": f"{type(e).__name__}: {e}"})
        finally:
            self.tasks.pop(n, None)

    async def _rollout(self, n: int, example: Any, state: dict[str, Any]) -> Any:
        """The env's own episode; its model calls go back to the orchestrator. The env's own code runs under the
        same clock as in process (primejax/envs/env_clock.py): an awaiting hang is cancelled here; a blocking one
        stops this loop, and the parent's liveness check replaces the process."""
        clock = EnvClock(self.env_timeout_s, "worker rollout")
        counter = itertools.count()

        async def model(messages: list[Any], tools: Any = None, *, trainable: bool = True) -> Any:
            k = next(counter)
            future = asyncio.get_running_loop().create_future()
            self.replies[n, k] = future
            self.send({"id": n, "model": k, "messages": messages, "tools": tools, "trainable": trainable})
            try:
                with clock.paused():
                    reply = await future
            finally:
                self.replies.pop((n, k), None)
            state.update(reply.get("state") or {})
            return reply.get("message")

        return await clock.run(self.env.rollout(example, state, model))


def _reader(loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue) -> None:
    for line in sys.stdin:
        loop.call_soon_threadsafe(inbox.put_nowait, line)
    loop.call_soon_threadsafe(inbox.put_nowait, None)


async def _main(out: Any) -> int:
    def send(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_reader, args=(loop, inbox), daemon=True).start()
    first = await inbox.get()
    if first is None:
        return 1
    init = json.loads(first)
    # The parent's import path in the parent's order, then anything only this process has. Not "missing entries
    # first": a directory the parent appended late (setuptools adds its _vendor folder, with an older
    # typing_extensions, when imported) would then shadow site-packages here.
    parent = init.get("sys_path", [])
    sys.path[:] = parent + [p for p in sys.path if p not in parent]
    try:
        from primejax.envs.registry import load_env

        env = load_env(init["env_id"], init.get("args") or {})
    except Exception as e:  # noqa: BLE001 - a bad env id / arg: the parent reports this line
        send({"fatal": f"{type(e).__name__}: {e}".splitlines()[0]})
        return 1
    worker = Worker(env, float(init["env_timeout_s"]), send)
    send({"ready": os.getpid()})
    while (line := await inbox.get()) is not None:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError as e:
            print(f"env worker {os.getpid()}: a line that is not JSON ignored ({e})", file=sys.stderr)
            continue
        if not isinstance(msg, dict):
            print(f"env worker {os.getpid()}: a line that is not a JSON object ignored", file=sys.stderr)
            continue
        worker.handle(msg)
    return 0


def main() -> int:
    # The protocol gets its own copy of stdout; fd 1 becomes stderr, so an env's prints go to the log.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return asyncio.run(_main(out))


if __name__ == "__main__":
    sys.exit(main())
