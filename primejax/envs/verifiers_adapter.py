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
- `env = "<vf Env id or module>"`: the Env's own `run(task, agents)` drives the episode; each agent's
  `interaction(task)` is a primejax stand-in whose `turn(message)` runs one agent segment (model calls until
  a reply without tool calls) through the orchestrator. The `policy_agent` (default `assistant`, else the
  first declared) is trained; other agents sample from the same server untrained.

Tasks that need verifiers' harness programs or a sandbox runtime run through verifiers' own rollout loop
instead (primejax/envs/verifiers_loop.py, chosen by the env's `args.driver`).

An id with a dot (`my_pkg.my_taskset`) is imported as a module path; verifiers' own loader only resolves
bare package names (`my-taskset` -> `my_taskset` or `verifiers.v1.tasksets.my_taskset`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
from typing import Any

from primejax.envs.base import Environment, Example, Message, ModelCall
from primejax.envs.tool_limits import (
    DEFAULT_MAX_TOOL_OUTPUT_CHARS,
    DEFAULT_TOOL_TIMEOUT_S,
    ToolTimeout,
    cap_tool_output,
    check_limits,
    with_timeout,
)


def _vf():
    import verifiers.v1 as vf  # deferred: verifiers takes seconds to import and most runs use builtins

    return vf


def _exported_subclass(module: Any, base: type, what: str) -> type:
    """The single `base` subclass a module exports via `__all__` (verifiers' plugin convention)."""
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    found = {
        obj
        for n in names
        if isinstance(obj := getattr(module, n, None), type)
        and issubclass(obj, base)
        and obj is not base
        and obj.__module__ == module.__name__
    }
    if len(found) != 1:
        raise TypeError(
            f"{what} module {module.__name__!r} must export exactly one {base.__name__} subclass, "
            f"found {sorted(c.__name__ for c in found)}"
        )
    return found.pop()


def load_taskset(taskset_id: str, args: dict[str, Any]) -> Any:
    """A verifiers taskset by id, its TasksetConfig built from `args` (validated by verifiers' pydantic model)."""
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type

    if "." in taskset_id:
        cls = _exported_subclass(importlib.import_module(taskset_id), vf.Taskset, "taskset")
        config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        return cls(config_cls.model_validate({**args, "id": taskset_id}))
    config_cls = vf.taskset_config_type(taskset_id)
    return vf.load_taskset(config_cls.model_validate({**args, "id": taskset_id}))


def _load_env(env_id: str, taskset_id: str, taskset_args: dict[str, Any], env_args: dict[str, Any]) -> Any:
    """A vf.Env holding only its config: primejax calls its `setup`/`run`, never its serving machinery."""
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type

    if "." in env_id:
        cls = _exported_subclass(importlib.import_module(env_id), vf.Env, "env")
    else:
        cls = vf.environment_class(taskset_id, env_id)
    config_cls = concrete_type(cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    # The taskset is loaded by primejax (module paths included), so the config validates the env's own fields
    # only; Env.__init__ would load the taskset again by verifiers' loader and every agent's harness, and
    # the stand-in needs only the config that `setup`/`run` read.
    config = config_cls.model_validate(env_args)
    env = cls.__new__(cls)
    env.config = config
    return env


def _to_dict(message: Any) -> Message:
    return message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        p.get("text", "") if isinstance(p, dict) else str(getattr(p, "text", "")) for p in content or []
    )


def _vf_message(message: Message) -> dict[str, Any]:
    """A primejax (OpenAI-style) message as verifiers' typed message: flat tool calls, no unknown keys."""
    out = {
        k: v
        for k, v in message.items()
        if k in ("role", "content", "reasoning_content", "tool_call_id", "name")
    }
    if message.get("role") == "assistant":
        out.setdefault("content", message.get("content") or "")
        calls = message.get("tool_calls")
        if calls:
            out["tool_calls"] = [
                {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in calls
            ]
    elif out.get("content") is None:
        out["content"] = ""
    return out


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

    async def open(self) -> None:
        from mcp.server.mcpserver import MCPServer

        for toolset in type(self.task).toolsets(self.task.config):
            self._share_state(toolset)
            await toolset.setup()
            await toolset.setup_task(self.task)
            server = MCPServer(toolset.server_name or type(toolset).__name__)
            toolset.register(server)
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
                message=self.message_adapter.validate_python(_vf_message(m)),
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
                messages=[self.message_adapter.validate_python(_vf_message(m)) for m in messages],
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
            message=self.message_adapter.validate_python(_vf_message(reply)),
        )
        for stop in self.response_stops:
            if await call_hook(stop, {vf.Response: response, vf.Trace: self.trace}):
                return stop.__name__
        return None

    async def call_tool(self, name: str, arguments: str) -> str:
        if name not in self.servers:
            return f"Error: unknown tool {name!r} (available: {sorted(self.servers)})"
        try:
            args = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError as e:
            return f"Error: tool arguments are not JSON ({e})"
        server, tool = self.servers[name]
        try:
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
        if not self.tasks:
            raise ValueError(f"taskset {taskset_id!r} yielded no tasks")
        self.num_examples = len(self.tasks)
        self.max_turns, self.max_output_tokens, self.max_total_tokens = (
            max_turns,
            max_output_tokens,
            max_total_tokens,
        )
        self.vf_env = _load_env(env, taskset_id, taskset_args, env_args or {}) if env else None
        # Kept for verifiers' own loop (primejax/envs/verifiers_loop.py), which rebuilds the env from them.
        self.taskset_args, self.vf_env_id, self.vf_env_args = dict(taskset_args), env, dict(env_args or {})
        self.policy_agent = policy_agent
        self._tools: dict[int, list[dict[str, Any]] | None] = {}

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
                prompt.extend(_to_dict(m) for m in data.prompt)
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
        world = _World(self, task)
        await world.open()
        self._tools[example.info["index"]] = world.tools or None
        state["world"] = world
        try:
            if self.vf_env is None:
                messages, sampled = list(example.prompt), [False] * len(example.prompt)
                messages, sampled, _ = await self.segment(world, messages, sampled, state, model)
            else:
                messages, sampled = await self._run_env(task, world, state, model)
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

    async def _run_env(
        self, task: Any, world: _World, state: dict[str, Any], model: ModelCall
    ) -> tuple[list[Message], list[bool]]:
        vf = _vf()
        from verifiers.v1.agent import Segment

        driver = self
        names = list(vf.Agents(self.vf_env.config, lambda name, spec: name)._agents)
        policy = self.policy_agent or ("assistant" if "assistant" in names else names[0])
        if policy not in names:
            raise ValueError(f"env.policy_agent: {policy!r} is not an agent of this env (agents: {names})")
        record: dict[str, Any] = {"messages": [], "sampled": []}

        class Interaction:
            def __init__(self, agent: Agent, task: Any):
                self.agent, self.terminated = agent, False
                self.world = world if agent.name == policy else _World(driver, task)
                data = task.data
                self.messages: list[Message] = (
                    [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
                )
                if data.prompt:
                    self.messages += (
                        [{"role": "user", "content": data.prompt}]
                        if isinstance(data.prompt, str)
                        else [_to_dict(m) for m in data.prompt]
                    )
                self.sampled = [False] * len(self.messages)

            async def turn(self, message: Any = None) -> Any:
                if self.terminated:
                    return Segment(messages=[], terminated=True)
                if message is not None:
                    new = (
                        [{"role": "user", "content": message}]
                        if isinstance(message, str)
                        else [_to_dict(m) for m in message]
                    )
                    self.messages, self.sampled = self.messages + new, self.sampled + [False] * len(new)
                before = len(self.messages)
                if self.agent.name == policy:
                    call = model
                else:

                    async def call(messages, tools=None):
                        return await model(messages, tools, trainable=False)

                self.messages, self.sampled, self.terminated = await driver.segment(
                    self.world, self.messages, self.sampled, state, call
                )
                if self.agent.name == policy:
                    record["messages"], record["sampled"] = self.messages, self.sampled
                produced = [
                    world.message_adapter.validate_python(_vf_message(m)) for m in self.messages[before:]
                ]
                return Segment(messages=produced, terminated=self.terminated and not produced)

        class Agent:
            def __init__(self, name: str):
                self.name, self.trainable = name, name == policy

            @contextlib.asynccontextmanager
            async def interaction(self, task: Any):
                inter = Interaction(self, task)
                if inter.world is not world:
                    await inter.world.open()
                inter.world.name_agent(self.name, self.trainable)
                try:
                    yield inter
                finally:
                    finished.append(inter.world)  # the episode's traces, in completion order

        finished: list[_World] = []
        agents_by_name = {n: Agent(n) for n in names}
        agents = vf.Agents(self.vf_env.config, lambda name, spec: agents_by_name[name])
        await self.vf_env.setup(agents)
        await self.vf_env.run(task, agents)
        state["vf_episode"] = finished  # judged after scoring, by `Env.finalize` (see `score`)
        return record["messages"], record["sampled"]

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
        trace.is_completed = trace.ok = True
        await world.task.score(trace)
        if (finished := state.pop("vf_episode", None)) is not None:
            await _finalize_episode(self.vf_env, world, finished)
        record_trace(state, trace)
        state.pop("world", None)  # not JSON; the trace's useful parts are copied above
        return float(trace.reward)


def record_trace(state: dict[str, Any], trace: Any) -> None:
    """What a scored verifiers trace tells the orchestrator's logs: stop condition, reward parts, metrics."""
    state["stop_condition"] = trace.stop_condition
    state["reward_components"] = {k: r.score for k, r in trace.rewards.items() if r is not None}
    state["metrics"] = {k: v for k, v in trace.metrics.items() if v is not None}


async def _finalize_episode(vf_env: Any, policy: _World, finished: list[_World]) -> None:
    """verifiers' end of an episode (`Env.run_episode`): every agent run's trace is judged by its own task,
    then `Env.finalize(task, episode)` judges across agents over the episode's traces in completion order; what
    it records on the policy trace (`record_reward` / `record_metric`) counts in the rollout's reward. A raise
    fails the episode there, and the rollout here."""
    from verifiers.v1.episode import EnvInfo, Episode
    from verifiers.v1.trace import TraceTask

    for w in finished:
        if w is not policy:
            w.trace.is_completed = w.trace.ok = True
            await w.task.score(w.trace)
    task = policy.task
    episode = Episode(
        env=EnvInfo(id=vf_env.config.env_id),
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        traces=[w.trace for w in finished],
    )
    await vf_env.finalize(task, episode)


def load(taskset_id: str, **args: Any) -> VerifiersEnv:
    return VerifiersEnv(taskset_id, **args)
