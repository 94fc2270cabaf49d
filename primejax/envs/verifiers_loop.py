"""verifiers' own rollout loop as a primejax environment: the fallback for tasks the in-process driver cannot run.

A verifiers env's `args.driver` picks who drives a rollout:

- `in_process` (primejax/envs/verifiers_adapter.py): the orchestrator makes every model call itself; tools,
  stops and scoring run in process. Milliseconds of overhead per rollout.
- `verifiers`: verifiers' own loop (`Env.run_episode`): a harness program per rollout (the `null` chat
  program by default, prepared with `uv`), a subprocess per toolset, verifiers' interception server between
  the program and the model. Its model calls go to primejax's vLLM server through verifiers' train client
  (`TrainClientConfig`: the renderers package renders, vLLM's token-in/token-out `/inference/v1/generate`
  samples, so the server must run with `--enable-scale-out`). verifiers records every call's exact prompt and
  completion ids and sampling logprobs on the trace's message graph; they become primejax trajectory steps
  unchanged. Seconds per rollout (docs/verifiers.md has the measurement).
- `auto` (default): in process, unless the task needs what only verifiers' loop provides: a container
  (`Task.NEEDS_CONTAINER`), runtime lifecycle hooks (`Task.setup` / `finalize` / `stage_verifier`), signals
  that take a `runtime`, a harness the taskset ships, or an explicit `args.harness`. The choice is logged.

What the fallback loses against the in-process driver: the policy version per turn (each turn is tagged with
the version read when the rollout started, a lower bound), primejax's parsing and malformed-tool-call count
(verifiers' renderer client parses), and traces other than the trained one (one seat's first run per episode,
rotating by example index as in process).

`uv` must be installed (`pip install uv`): verifiers launches harness programs with it, and without it would
try to install it into the user's home itself; the driver refuses to start instead. A taskset given as a module
path is made importable by verifiers' loader and the toolset subprocesses (its root goes on PYTHONPATH).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import inspect
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from primejax.envs.base import Endpoint, Example, Message, SampledRollout, SampledTurn
from primejax.envs.verifiers_adapter import VerifiersEnv, _vf, record_trace

log = logging.getLogger(__name__)

DRIVERS = ("auto", "in_process", "verifiers")
#: verifiers' own harness for a plain chat loop with MCP tools (its default, `bash`, is a coding agent).
DEFAULT_HARNESS = "null"
#: The variable verifiers reads the API key from when the run sets none (unset: it sends no real key).
NO_API_KEY_VAR = "PRIMEJAX_NO_API_KEY"
#: The stages of a verifiers rollout that run the env's code and no model call: bounded by env_timeout_s.
ENV_STAGES = ("setup", "finalize", "scoring")


def load(
    taskset_id: str,
    *,
    driver: str = "auto",
    harness: str = "",
    harness_args: dict[str, Any] | None = None,
    runtime: str = "subprocess",
    **args: Any,
) -> VerifiersEnv:
    """A verifiers taskset driven in process or by verifiers' own loop, as `driver` says (module docstring)."""
    where = f"verifiers env {taskset_id!r}"
    if driver not in DRIVERS:
        raise ValueError(
            f"{where}: args.driver must be one of {', '.join(DRIVERS)} or env_server (got {driver!r})"
        )
    if driver == "in_process" and (harness or harness_args):
        raise ValueError(
            f"{where}: args.harness needs args.driver = 'verifiers' (the in-process driver has none)"
        )
    env = VerifiersEnv(taskset_id, **args)
    if driver == "in_process":
        return env
    reasons = in_process_blockers(env, harness)
    if driver == "auto" and not reasons:
        return env
    shipped = _shipped_harness(taskset_id)
    chosen = harness or shipped or DEFAULT_HARNESS
    if driver == "auto":
        log.warning(
            "%s: driver auto chose verifiers' own rollout loop (harness %r, runtime %r): %s. Expect seconds per "
            "rollout (a harness program each) instead of the in-process driver's milliseconds.",
            where,
            chosen,
            runtime,
            "; ".join(reasons),
        )
    return VerifiersLoopEnv.wrap(env, harness=chosen, harness_args=harness_args or {}, runtime=runtime)


def _requires_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def in_process_blockers(env: VerifiersEnv, harness: str = "") -> list[str]:
    """Why the in-process driver cannot run this taskset's tasks ([] = it can)."""
    vf = _vf()
    reasons = [f"args.harness = {harness!r}"] if harness else []
    task = env.tasks[0]
    cls = type(task)
    if cls.NEEDS_CONTAINER:
        reasons.append(f"{cls.__name__}.NEEDS_CONTAINER")
    for hook in ("setup", "finalize", "stage_verifier"):
        if getattr(cls, hook) is not getattr(vf.Task, hook):
            reasons.append(f"{cls.__name__}.{hook} needs a runtime")
    signals = [fn.__name__ for fn in (*task.hooks("reward"), *task.hooks("metric")) if _requires_runtime(fn)]
    signals += [j.reward_name for j in task.plugged_judges() if _requires_runtime(j.score)]
    if signals:
        reasons.append(f"signals that need a runtime: {', '.join(signals)}")
    if shipped := _shipped_harness(env.taskset_id):
        reasons.append(f"the taskset ships its own harness {shipped!r}")
    return reasons


def _shipped_harness(taskset_id: str) -> str:
    """The harness a taskset package ships (verifiers runs it by default), else ''."""
    vf = _vf()
    if "." in taskset_id:
        module = importlib.import_module(taskset_id)
        names = getattr(module, "__all__", None) or []
        found = [
            n for n in names if isinstance(c := getattr(module, n, None), type) and issubclass(c, vf.Harness)
        ]
        return _alias(taskset_id) if found else ""
    from verifiers.v1.utils.loaders import default_harness_id

    ident = default_harness_id(taskset_id)
    return "" if ident == "bash" else ident


def _alias(module_path: str) -> str:
    """A bare module name for a dotted module path: verifiers' loader resolves bare package names only."""
    alias = "primejax_vf_" + hashlib.sha1(module_path.encode()).hexdigest()[:10]
    if alias not in sys.modules:
        sys.modules[alias] = importlib.import_module(module_path)
    return alias


def _importable_by_children(module_path: str) -> None:
    """Put the root a module path imports from on PYTHONPATH: verifiers serves each toolset as
    `python -m <its module>` in a subprocess."""
    module = importlib.import_module(module_path)
    file = Path(module.__file__ or "").resolve()
    depth = module_path.count(".") + (1 if file.name == "__init__.py" else 0)
    root = str(file.parents[depth])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, root])
        log.info("verifiers loop: %s on PYTHONPATH (toolset subprocesses import %s)", root, module_path)


def ensure_uv() -> str:
    """The `uv` executable verifiers launches harness programs with, put on PATH; refuses to start without it
    (verifiers would otherwise `pip install --user uv` into the home directory)."""
    found = shutil.which("uv")
    if found:
        return found
    try:
        import uv  # the PyPI package ships the binary next to the interpreter's scripts

        found = uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        raise RuntimeError(
            "args.driver = 'verifiers' needs uv (`pip install uv`): verifiers launches its harness programs with it"
        ) from None
    os.environ["PATH"] = os.pathsep.join([str(Path(found).parent), os.environ.get("PATH", "")])
    log.info("verifiers loop: %s on PATH (uv)", Path(found).parent)
    return found


def renderer_config(renderer: Any) -> Any:
    """The renderers-package config verifiers' train client renders with: the orchestrator's own renderer, so
    both drivers render a conversation to the same ids."""
    from primejax.rendering.renderer import ChatTemplateRenderer
    from primejax.rendering.renderers_adapter import PackageRenderer

    if isinstance(renderer, PackageRenderer):
        return renderer.impl.config
    if isinstance(renderer, ChatTemplateRenderer):
        from renderers.configs import config_from_name

        return config_from_name("default")
    raise ValueError(
        f"args.driver = 'verifiers' renders through the renderers package; orchestrator.renderer "
        f"{type(renderer).__name__} is primejax's own: set orchestrator.renderer.name to 'auto', 'default' or a family"
    )


def _one_line(error: Exception, roles: set[str]) -> str:
    """A verifiers config error as one line naming the primejax key (`args.harness`, `args.runtime`, ...)."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return str(error).split(". ")[0].splitlines()[0]
    first = error.errors()[0]
    loc = [str(p) for p in first["loc"]]
    if loc and loc[0] in roles:
        seat = {"harness": "args.harness_args", "runtime": "args.runtime"}.get(loc[1] if len(loc) > 1 else "")
        key = ".".join([seat, *loc[2:]]) if seat else "args." + ".".join(loc[1:])
    elif loc and loc[0] == "taskset":
        key = "args." + ".".join(loc[1:])
    else:
        key = "args.env_args." + ".".join(loc)
    return f"{key}: {first['msg']}"


class VerifiersLoopEnv(VerifiersEnv):
    """A verifiers taskset whose rollouts run through verifiers' own loop (see module docstring)."""

    drives_rollout = False
    samples_itself = True

    @classmethod
    def wrap(
        cls, env: VerifiersEnv, *, harness: str, harness_args: dict[str, Any], runtime: str
    ) -> VerifiersLoopEnv:
        """The loop driver over an already loaded in-process env (its tasks, examples and limits)."""
        self = cls.__new__(cls)
        self.__dict__.update(env.__dict__)
        self.harness, self.harness_args, self.runtime = harness, dict(harness_args), runtime
        self._loop_envs: dict[tuple[int, float | None], Any] = {}
        self._serving: dict[int, tuple[asyncio.AbstractEventLoop, contextlib.AsyncExitStack]] = {}
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        ensure_uv()
        for module_path in (self.taskset_id, self.vf_env_id):
            if "." in module_path:
                _importable_by_children(module_path)
        self._build(self.max_turns)  # a bad harness / runtime / env arg fails at load, one line
        return self

    def _build(self, max_turns: int, env_timeout_s: float | None = None) -> Any:
        """verifiers' Env for this taskset, every agent seat on the chosen harness and runtime. `env_timeout_s`
        (orchestrator.env_timeout_s) becomes verifiers' own deadlines for the env's code that makes no model call:
        each seat's task setup, finalize and scoring, and the Env's finalize (a hung one fails the episode, so its
        rollout errors); the agent's solve attempt (model and tool calls) keeps verifiers' own limits."""
        if (max_turns, env_timeout_s) in self._loop_envs:
            return self._loop_envs[max_turns, env_timeout_s]
        vf = _vf()
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils.generic import concrete_type
        from verifiers.v1.utils.loaders import environment_class

        taskset = _alias(self.taskset_id) if "." in self.taskset_id else self.taskset_id
        if self.vf_env is not None:
            env_cls = type(self.vf_env)
        else:
            env_cls = environment_class(taskset)
        config_cls = concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
        env_args = dict(self.vf_env_args)
        seat = {
            "harness": {**self.harness_args, "id": self.harness},
            "runtime": {"type": self.runtime},
            "max_turns": max_turns,
            "max_output_tokens": self.max_output_tokens,
            "max_total_tokens": self.max_total_tokens,
        }
        if env_timeout_s is not None:
            seat["timeout"] = dict.fromkeys(ENV_STAGES, env_timeout_s)
            env_args["timeout"] = {**env_args.get("timeout", {}), "finalize": env_timeout_s}
        roles = agent_config_fields(config_cls.model_validate(env_args))
        taskset_args = {**self.taskset_args, "id": taskset}
        try:
            config = config_cls.model_validate(
                {**env_args, "taskset": taskset_args, **dict.fromkeys(roles, seat)}
            )
        except Exception as e:  # noqa: BLE001 - any bad harness / runtime / env arg: one line naming the key
            raise ValueError(f"verifiers env {self.taskset_id!r}: {_one_line(e, set(roles))}") from None
        env = env_cls(config)
        self._loop_envs[max_turns, env_timeout_s] = env
        return env

    async def _serve(self, env: Any) -> None:
        """verifiers' serving resources (interception server, taskset-level tool servers), once per event loop."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        async with self._lock[1]:
            held = self._serving.get(id(env))
            if held is not None and held[0] is loop:
                return
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(env.serving())
            self._serving[id(env)] = (loop, stack)

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        for key, (owner, stack) in list(self._serving.items()):
            if owner is loop:
                await stack.aclose()
            del self._serving[key]

    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        if "vf_reward" in state:  # scored by verifiers' loop
            return state.pop("vf_reward")
        return await super().score(example, messages, state)

    async def sample_rollout(
        self, example: Example, state: dict[str, Any], endpoint: Endpoint
    ) -> SampledRollout:
        # max_turns: already this env's cap and the orchestrator's, >= 1
        env = self._build(endpoint.max_turns, endpoint.env_timeout_s)
        await self._serve(env)
        index = example.info["index"]
        episode = await env.run_episode(self.tasks[index], model_context(endpoint))
        return episode_to_rollout(
            episode, getattr(self, "policy_agents", []), state, getattr(self, "seats", []), index
        )


def model_context(endpoint: Endpoint) -> Any:
    """verifiers' model context for one rollout: the orchestrator's server, model and sampling settings."""
    vf = _vf()
    from verifiers.v1.clients import ModelContext

    sampling = {
        "temperature": endpoint.temperature,
        "top_p": endpoint.top_p,
        "max_tokens": endpoint.max_tokens,
    }
    if endpoint.seed is not None:
        sampling["seed"] = endpoint.seed
    return ModelContext(model=endpoint.model, client=train_client(endpoint), sampling=vf.Sampling(**sampling))


def train_client(endpoint: Endpoint) -> Any:
    """verifiers' client config for the orchestrator's server: its API key comes from the orchestrator's own
    client's variable (orchestrator.client.api_key_env), never PRIME_API_KEY, which verifiers would fill from the
    Prime CLI's config."""
    from verifiers.v1.clients import TrainClientConfig

    return TrainClientConfig(
        base_url=endpoint.base_url.rstrip("/") + "/v1",
        api_key_var=endpoint.api_key_var or NO_API_KEY_VAR,
        renderer=renderer_config(endpoint.renderer),
        renderer_model_name=endpoint.model,
    )


def trained_trace(episode: Any, policy_agents: list[str], seats: list[str], seat_index: int) -> Any:
    """The trace a rollout trains: of the trainable seats (narrowed by `policy_agents`), the one `seat_index`
    picks in rotation (the in-process driver's rule: a group = one game x seat; `seats` gives their order), its
    first run; a seat that made no model call (the other forfeited) passes to the next."""
    traces = [
        t
        for t in episode.traces
        if t.agent.trainable and (not policy_agents or t.agent.name in policy_agents)
    ]
    named = list(dict.fromkeys(t.agent.name for t in traces))
    order = [s for s in seats if s in named] + [n for n in named if n not in seats]
    if not order:
        raise RuntimeError("the verifiers episode has no trainable trace")
    k = seat_index % len(order)
    for seat in order[k:] + order[:k]:
        first = next(t for t in traces if t.agent.name == seat)
        if len(order) == 1 or any(n.sampled for n in first.nodes):
            return first
    raise RuntimeError(f"no trainable seat of the verifiers episode made a model call ({', '.join(order)})")


def episode_to_rollout(
    episode: Any, policy_agents: list[str], state: dict[str, Any], seats: list[str] = (), seat_index: int = 0
) -> SampledRollout:
    """The trained trace of a verifiers episode (`trained_trace`) as primejax turns: along the trace's main
    branch, each sampled message node's prompt is every token before its completion span (earlier nodes' ids +
    its own generation-prompt scaffold), its completion the masked span, its logprobs the node's, as recorded."""
    from verifiers.v1.dialects.chat import message_to_wire

    if not episode.ok:
        errors = "; ".join(f"{e.type}: {e.message}" for e in episode.errors) or "not ok"
        trace_errors = "; ".join(f"{e.type}: {e.message}" for t in episode.traces for e in t.errors)
        raise RuntimeError(
            f"verifiers episode failed: {errors}" + (f" ({trace_errors})" if trace_errors else "")
        )
    trace = trained_trace(episode, policy_agents, list(seats), seat_index)
    # verifiers stops a trace whose stage deadline expired (a stop, not a failure: its reward may be unscored);
    # the env's stages run under orchestrator.env_timeout_s (VerifiersLoopEnv._build), so the rollout errors.
    stage = trace.stop_condition.removesuffix("_timeout") if trace.stop_condition else ""
    if stage in ENV_STAGES:
        raise RuntimeError(
            f"verifiers' task {stage} did not finish within its deadline (orchestrator.env_timeout_s)"
        )
    parents = {n.parent for n in trace.nodes if n.parent is not None}
    leaves = [i for i in range(len(trace.nodes)) if i not in parents]

    def path(leaf: int) -> list[int]:
        out: list[int] = []
        node: int | None = leaf
        while node is not None:
            out.append(node)
            node = trace.nodes[node].parent
        return out[::-1]

    main = max((path(leaf) for leaf in leaves), key=lambda p: (sum(trace.nodes[i].sampled for i in p), p[-1]))
    finish = {c.node: c.finish_reason for c in trace.calls if c.node is not None}
    turns: list[SampledTurn] = []
    prefix: list[int] = []
    for i in main:
        node = trace.nodes[i]
        if node.sampled:
            if not node.token_ids:
                raise RuntimeError("verifiers recorded no token ids for a model call (a relay client?)")
            start = node.mask.index(True) if True in node.mask else len(node.token_ids)
            if not all(node.mask[start:]) or len(node.logprobs) != len(node.token_ids) - start:
                raise RuntimeError(
                    f"message node {i}: the sampled span is not one completion with its logprobs"
                )
            turns.append(
                SampledTurn(
                    prompt_ids=prefix + node.token_ids[:start],
                    completion_ids=list(node.token_ids[start:]),
                    completion_logprobs=list(node.logprobs),
                    finish_reason=str(finish.get(i) or "stop"),
                )
            )
        prefix += node.token_ids
    record_trace(state, trace)
    state["vf_branches"] = len(leaves)
    # verifiers scored the trace (with its runtime); `score` returns it
    state["vf_reward"] = float(trace.reward)
    messages = [message_to_wire(trace.nodes[i].message) for i in main]
    return SampledRollout(messages=messages, turns=turns)
