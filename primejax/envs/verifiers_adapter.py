"""verifiers v1 tasksets (and their `Env.run`) as primejax Environments, driven in process.

verifiers changes its API between minor releases (0.4 kept only `verifiers.v1`), so everything primejax uses
of it is here and in verifiers_loop.py (verifiers' own loop), checked by tests/envs/test_verifiers_api.py. The
orchestrator keeps every model call (token ids, sampling logprobs, policy version per turn) and drives the
task in process:

- tools: the task's `toolsets(config)` are instantiated per rollout (`setup`, `setup_task`) and registered on
  an in-process MCP server; the model sees them as `{server}_{tool}` (verifiers' naming); calls run in
  process, the toolset instance and its `State` (shared with the rollout's trace, as verifiers' state channel
  does) persist across calls of one rollout. A tool call the renderer could not parse is answered with a tool
  error message and counted.
- stops, as `@vf.stop`'s annotation says: `Trace` stops and the limits before each model call, `Request`
  stops on the outgoing request, `Response` stops on each reply (verifiers' RolloutSession / hook_boundary).
  Limits: `max_turns` (also capped by `orchestrator.sampling.max_turns`), `max_output_tokens`,
  `max_total_tokens` (soft by one turn, as verifiers').
- scoring: `await task.score(trace)` on a trace holding the conversation, its state and stop condition.
- Envs: the Env a taskset package ships (e.g. verifiers' `textarena`: the game engine plays the user), or
  `args.env = "<vf Env id or module>"`, runs its own `setup` / `run(task, agents)` / `finalize` episode; its
  seats are primejax's (primejax/envs/verifiers_episode.py: which seat trains, `args.policy_agent`).

Tasks that need verifiers' harness programs or a sandbox runtime run through verifiers' own rollout loop
instead (primejax/envs/verifiers_loop.py, chosen by the env's `args.driver`).

Ids (and import errors) resolve as primejax/envs/verifiers_ids.py says.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from typing import Any

from primejax.envs import env_clock
from primejax.envs.base import Environment, Example, Message, ModelCall
from primejax.envs.env_limits import pace_tool_call
from primejax.envs.tool_limits import (
    DEFAULT_MAX_TOOL_OUTPUT_CHARS,
    DEFAULT_TOOL_TIMEOUT_S,
    ToolTimeout,
    cap_tool_output,
    check_limits,
    with_timeout,
)
from primejax.envs.verifiers_episode import Episode, parse_policy_agents, seat_names
from primejax.envs.verifiers_ids import load_taskset, load_vf_env
from primejax.envs.verifiers_messages import to_dict, vf_message


def _vf():
    import verifiers.v1 as vf  # deferred: verifiers takes seconds to import and most runs use builtins

    return vf


#: The trace of the rollout whose tool call is running: a taskset-scoped toolset is one instance shared by every
#: rollout, and its `State` is the calling rollout's (verifiers keys it by the per-rollout state channel).
CALLING_TRACE: contextvars.ContextVar[Any] = contextvars.ContextVar("primejax_vf_calling_trace")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        p.get("text", "") if isinstance(p, dict) else str(getattr(p, "text", "")) for p in content or []
    )


class _World:
    """One rollout's in-process verifiers world: trace (with state), toolsets on an MCP server, stop hooks."""

    def __init__(self, env: VerifiersEnv, task: Any):
        vf = _vf()
        from pydantic import TypeAdapter
        from verifiers.v1.session import hook_boundary
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, TraceTask

        self.env, self.task = env, task
        self.trace = vf.Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=AgentInfo(config=vf.AgentConfig()),
        )
        stops = [(hook_boundary(fn, allow_trace=True), fn) for fn in task.hooks("stop")]
        self.trace_stops = [fn for b, fn in stops if b is vf.Trace]
        self.request_stops = [fn for b, fn in stops if b is vf.Request]
        self.response_stops = [fn for b, fn in stops if b is vf.Response]
        self.message_adapter = TypeAdapter(vf.Message)
        self.servers: dict[str, tuple[Any, Any]] = {}  # advertised name -> (mcp server, tool name)
        self.tools: list[dict[str, Any]] = []
        self.sampled: list[bool] = []
        self.scored = False

    async def open(self) -> None:
        from mcp.server.mcpserver import MCPServer

        for toolset in type(self.task).toolsets(self.task.config):
            self._share_state(toolset)
            await toolset.setup()
            # As verifiers hands a tool server its rollout's task: the TaskData, a copy (it crosses a process
            # boundary there).
            await toolset.setup_task(self.task.data.model_copy(deep=True))
            server = MCPServer(toolset.server_name or type(toolset).__name__)
            toolset.register(server)
            await self._advertise(toolset, server)
        # The taskset's shared servers ride only its own tasks (verifiers' `_EpisodeAgent._shared_for`).
        if isinstance(self.task, tuple(type(t) for t in self.env.tasks[:1])):
            for toolset, server in await self.env.shared_toolsets():
                await self._advertise(toolset, server)

    async def _advertise(self, toolset: Any, server: Any) -> None:
        prefix = f"{toolset.server_name}_" if toolset.server_name else ""
        for tool in await server.list_tools():
            name = prefix + tool.name
            self.servers[name] = (server, tool.name)
            self.tools.append(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": tool.description or "",
                        # As an MCP client receives it (verifiers' harness programs do): the wire puts
                        # `type` first, and the schema is printed into the prompt as JSON.
                        "parameters": {
                            "type": tool.input_schema.get("type", "object"),
                            **tool.input_schema,
                        },
                    },
                }
            )

    def _share_state(self, toolset: Any) -> None:
        """verifiers syncs a toolset's State with the rollout's through an HTTP channel per call; in process the
        toolset reads and writes the trace's state directly (validated into its own State type)."""
        trace = self.trace

        async def pull() -> Any:
            return toolset._state_adapter.validate_python(trace.state.model_dump())

        async def push(before: bytes) -> None:
            current = toolset.state
            trace.state = type(trace.state).model_validate(current.model_dump())

        if toolset._state_cls is not _vf().State:
            toolset._pull_state, toolset._push_state = pull, push

    def sync(self, messages: list[Message], sampled: list[bool]) -> None:
        """Point the trace's message graph at `messages` (one branch; `sampled` marks model replies)."""
        from verifiers.v1.graph import MessageNode

        self.trace.nodes = [
            MessageNode(
                parent=i - 1 if i else None,
                sampled=s,
                message=self.message_adapter.validate_python(vf_message(m)),
            )
            for i, (m, s) in enumerate(zip(messages, sampled, strict=True))
        ]

    async def refused(self, messages: list[Message], state: dict[str, Any]) -> str | None:
        """Limits, `Trace` stops and `Request` stops before a model call; the reason, or None."""
        from verifiers.v1.session import call_hook

        vf = _vf()
        e = self.env
        if e.max_output_tokens is not None and state.get("output_tokens", 0) >= e.max_output_tokens:
            return "max_output_tokens"
        if e.max_total_tokens is not None and state.get("total_tokens", 0) >= e.max_total_tokens:
            return "max_total_tokens"
        for stop in self.trace_stops:
            if await call_hook(stop, {vf.Trace: self.trace}):
                return stop.__name__
        if self.request_stops:
            request = vf.Request(
                messages=[self.message_adapter.validate_python(vf_message(m)) for m in messages],
                tools=[vf.Tool(**t["function"]) for t in self.tools] or None,
            )
            for stop in self.request_stops:
                if await call_hook(stop, {vf.Request: request, vf.Trace: self.trace}):
                    return stop.__name__
        return None

    async def response_stop(self, reply: Message) -> str | None:
        from verifiers.v1.session import call_hook

        vf = _vf()
        if not self.response_stops:
            return None
        response = vf.Response(
            id="primejax",
            created=0,
            model="policy",
            finish_reason="stop",
            message=self.message_adapter.validate_python(vf_message(reply)),
        )
        for stop in self.response_stops:
            if await call_hook(stop, {vf.Response: response, vf.Trace: self.trace}):
                return stop.__name__
        return None

    async def call_tool(self, name: str, arguments: str) -> str:
        token = CALLING_TRACE.set(
            self.trace
        )  # a shared toolset's state is this rollout's (see shared_toolsets)
        try:
            return await self._call_tool(name, arguments)
        finally:
            CALLING_TRACE.reset(token)

    async def _call_tool(self, name: str, arguments: str) -> str:
        if name not in self.servers:
            return f"Error: unknown tool {name!r} (available: {sorted(self.servers)})"
        try:
            args = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError as e:
            return f"Error: tool arguments are not JSON ({e})"
        server, tool = self.servers[name]
        await pace_tool_call()  # the env's tool-call rate (orchestrator.envs.<name>.limits)
        try:
            with env_clock.paused():  # a tool call has its own limit (tool_timeout_s), not the env's
                result = await with_timeout(
                    server.call_tool(tool, args if isinstance(args, dict) else {}),
                    self.env.tool_timeout_s,
                    f"tool {name!r}",
                )
        except ToolTimeout:
            raise  # a hung tool errors its rollout (tool_limits.py); the others go on
        except Exception as e:  # noqa: BLE001 - a failing tool is the model's observation, as in verifiers
            return cap_tool_output(f"Error: {type(e).__name__}: {e}", self.env.max_tool_output_chars)
        blocks = getattr(result, "content", result)
        if isinstance(blocks, (list, tuple)):
            text = "\n".join(getattr(b, "text", str(b)) for b in blocks)
        else:
            text = str(blocks)
        return cap_tool_output(text, self.env.max_tool_output_chars)  # before anything tokenizes it

    async def close(self) -> None:
        self.servers.clear()

    def name_agent(self, name: str, trainable: bool) -> None:
        """Stamp the trace with the env agent that produced it, as verifiers does (`Episode.by_agent`)."""
        self.trace.agent.name, self.trace.agent.trainable = name, trainable


class VerifiersEnv(Environment):
    """A verifiers taskset driven in process (see module docstring)."""

    drives_rollout = True

    def __init__(
        self,
        taskset_id: str,
        num_examples: int | None = None,
        max_turns: int = 8,
        max_output_tokens: int | None = None,
        max_total_tokens: int | None = None,
        env: str = "",
        env_args: dict[str, Any] | None = None,
        policy_agent: str = "",
        max_tool_output_chars: int = DEFAULT_MAX_TOOL_OUTPUT_CHARS,
        tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
        **taskset_args: Any,
    ):
        check_limits(max_tool_output_chars, tool_timeout_s)
        self.max_tool_output_chars, self.tool_timeout_s = max_tool_output_chars, tool_timeout_s
        taskset = load_taskset(taskset_id, taskset_args)
        if num_examples is not None:
            taskset = taskset.take(num_examples)
        elif not taskset.bounded:
            raise ValueError(f"taskset {taskset_id!r} is infinite: set args.num_examples")
        self.taskset_id = taskset_id
        self.tasks = list(taskset)
        self._taskset_toolsets = type(taskset).toolsets(taskset.config)
        self._shared: tuple[asyncio.AbstractEventLoop, asyncio.Lock, list[tuple[Any, Any]] | None] | None = (
            None
        )
        if not self.tasks:
            raise ValueError(f"taskset {taskset_id!r} yielded no tasks")
        self.num_examples = len(self.tasks)
        self.max_turns, self.max_output_tokens, self.max_total_tokens = (
            max_turns,
            max_output_tokens,
            max_total_tokens,
        )
        self.vf_env = load_vf_env(env, taskset_id, env_args or {})
        # Kept for verifiers' own loop (primejax/envs/verifiers_loop.py), which rebuilds the env from them.
        self.taskset_args, self.vf_env_id, self.vf_env_args = dict(taskset_args), env, dict(env_args or {})
        self.policy_agent = policy_agent
        where = f"verifiers env {taskset_id!r}"
        if self.vf_env is not None:
            self.seats = seat_names(self.vf_env)
            self.policy_agents = parse_policy_agents(policy_agent, self.seats, where)
        elif policy_agent:
            raise ValueError(
                f"{where}: args.policy_agent needs an Env with seats (args.env, or one the taskset ships)"
            )
        self._tools: dict[int, list[dict[str, Any]] | None] = {}

    def world(self, task: Any) -> _World:
        """A fresh in-process world for one rollout of `task` (an Env's seats open theirs through this)."""
        return _World(self, task)

    async def shared_toolsets(self) -> list[tuple[Any, Any]]:
        """The taskset's own toolsets (`Taskset.toolsets`): built and `setup` once (per event loop), no
        `setup_task`, one in-process MCP server each, shared by every rollout; each call reads and writes the
        calling rollout's `State` (CALLING_TRACE), as verifiers' per-rollout state channel does."""
        if not self._taskset_toolsets:
            return []
        from mcp.server.mcpserver import MCPServer

        loop = asyncio.get_running_loop()
        if self._shared is None or self._shared[0] is not loop:
            self._shared = (loop, asyncio.Lock(), None)
        _, lock, _ = self._shared
        async with lock:
            if self._shared[2] is None:
                built = []
                for toolset in self._taskset_toolsets:
                    _share_calling_state(toolset)
                    await toolset.setup()
                    server = MCPServer(toolset.server_name or type(toolset).__name__)
                    toolset.register(server)
                    built.append((toolset, server))
                self._shared = (loop, lock, built)
        return self._shared[2]

    # ------------------------------------------------------------------------------------------ examples

    def example(self, index: int) -> Example:
        task = self.tasks[index]
        data = task.data
        prompt: list[Message] = []
        if self.vf_env is None:  # an Env's own run opens the conversation
            if data.system_prompt:
                prompt.append({"role": "system", "content": data.system_prompt})
            if isinstance(data.prompt, str):
                prompt.append({"role": "user", "content": data.prompt})
            elif data.prompt:
                prompt.extend(to_dict(m) for m in data.prompt)
        answer = getattr(data, "answer", None)
        return Example(
            key=f"{self.taskset_id}/{task.key}", prompt=prompt, answer=answer, info={"index": index}
        )

    async def tools(self, example: Example) -> list[dict[str, Any]] | None:
        """The task's tool schemas, listed once per task from an in-process MCP server."""
        index = example.info["index"]
        if index not in self._tools:
            world = _World(self, self.tasks[index])
            await world.open()
            self._tools[index] = world.tools or None
        return self._tools[index]

    # ------------------------------------------------------------------------------------------ rollouts

    async def rollout(self, example: Example, state: dict[str, Any], model: ModelCall) -> list[Message]:
        task = self.tasks[example.info["index"]]
        if (
            self.vf_env is not None
        ):  # the Env's own episode (verifiers_episode.py): its seats open their worlds
            # A trained seat that never got a turn (the other seat forfeited first) leaves nothing to train on:
            # the episode is played again training the next trainable seat, once per seat at most.
            for attempt in range(max(1, len(self.seats))):
                episode = Episode(self, state, model, example.info["index"] + attempt)
                messages = await episode.run(task)
                if episode.played:
                    break
            state["vf_episode"] = episode  # finalized after scoring (see `score`)
            state["world"] = episode.policy
            return messages
        world = _World(self, task)
        await world.open()
        self._tools[example.info["index"]] = world.tools or None
        state["world"] = world
        try:
            messages, sampled = list(example.prompt), [False] * len(example.prompt)
            messages, sampled, _ = await self.segment(world, messages, sampled, state, model)
        finally:
            await world.close()
        world.sync(messages, sampled)
        return messages

    async def segment(
        self,
        world: _World,
        messages: list[Message],
        sampled: list[bool],
        state: dict[str, Any],
        model: ModelCall,
    ) -> tuple[list[Message], list[bool], bool]:
        """Model calls until a reply without tool calls; returns (messages, sampled, terminated)."""
        while True:
            world.sync(messages, sampled)
            if (reason := await world.refused(messages, state)) is not None:
                world.trace.stop(reason)
                return messages, sampled, True
            reply = await model(messages, world.tools or None)
            if reply is None:
                world.trace.stop("max_turns")
                return messages, sampled, True
            messages, sampled = [*messages, reply], [*sampled, True]
            world.sync(messages, sampled)
            if (reason := await world.response_stop(reply)) is not None:
                world.trace.stop(reason)
                return messages, sampled, True
            results = [
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "name": call["function"]["name"],
                    "content": await world.call_tool(call["function"]["name"], call["function"]["arguments"]),
                }
                for call in reply.get("tool_calls") or []
            ]
            results += [
                {
                    "role": "tool",
                    "tool_call_id": f"malformed_{i}",
                    "content": f"Error: could not parse this tool call ({bad['status']}): {bad['raw']}",
                }
                for i, bad in enumerate(state.get("malformed_tool_calls") or [])
            ]
            if not results:
                return messages, sampled, False
            messages, sampled = messages + results, sampled + [False] * len(results)

    # ------------------------------------------------------------------------------------------ scoring

    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        world = state.get("world")
        if world is None:  # scoring a conversation not driven here (tests, offline evals)
            world = _World(self, self.tasks[example.info["index"]])
            world.sync(
                messages,
                [m.get("role") == "assistant" and i >= len(example.prompt) for i, m in enumerate(messages)],
            )
        trace = world.trace
        if not world.scored:  # an Env's interactions were scored when they closed, as verifiers does
            trace.is_completed = trace.ok = True
            await world.task.score(trace)
        if (episode := state.pop("vf_episode", None)) is not None:
            await episode.finalize(self.tasks[example.info["index"]])
        record_trace(state, trace)
        state.pop("world", None)  # not JSON; the trace's useful parts are copied above
        return float(trace.reward)


def _share_calling_state(toolset: Any) -> None:
    """A shared toolset's state channel in process: the calling rollout's trace state (CALLING_TRACE)."""

    async def pull() -> Any:
        return toolset._state_adapter.validate_python(CALLING_TRACE.get().state.model_dump())

    async def push(before: bytes) -> None:
        trace = CALLING_TRACE.get()
        trace.state = type(trace.state).model_validate(toolset.state.model_dump())

    if toolset._state_cls is not _vf().State:
        toolset._pull_state, toolset._push_state = pull, push


def record_trace(state: dict[str, Any], trace: Any) -> None:
    """What a scored verifiers trace tells the orchestrator's logs: stop condition, reward parts, metrics."""
    state["stop_condition"] = trace.stop_condition
    state["reward_components"] = {k: r.score for k, r in trace.rewards.items() if r is not None}
    state["metrics"] = {k: v for k, v in trace.metrics.items() if v is not None}


def load(taskset_id: str, **args: Any) -> VerifiersEnv:
    return VerifiersEnv(taskset_id, **args)
