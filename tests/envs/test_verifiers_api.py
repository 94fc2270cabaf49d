"""The verifiers / renderers / MCP surface primejax's two adapter modules rely on (envs/verifiers_adapter.py,
rendering/renderers_adapter.py), including the private parts they reach into: a version bump that moves
any of it fails here, by name, instead of inside a rollout."""

from __future__ import annotations

import inspect


def test_verifiers_v1_surface():
    import verifiers.v1 as vf
    from verifiers.v1.agent import Segment
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.mcp.server import ServerBase
    from verifiers.v1.session import call_hook, hook_boundary
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, TraceTask
    from verifiers.v1.utils.generic import concrete_type

    for name in (
        "Taskset",
        "TasksetConfig",
        "Task",
        "TaskData",
        "Toolset",
        "ToolsetConfig",
        "State",
        "Env",
        "EnvConfig",
        "Agents",
        "AgentConfig",
        "Trace",
        "Request",
        "Response",
        "Tool",
        "Message",
        "stop",
        "tool",
        "reward",
        "metric",
        "load_taskset",
        "taskset_config_type",
        "environment_class",
    ):
        assert hasattr(vf, name), name
    assert {"trace", "runtime"} <= set(inspect.signature(vf.Task.score).parameters)
    assert callable(vf.Task.toolsets) and callable(vf.Task.hooks)
    assert {"parent", "message", "sampled"} <= set(MessageNode.model_fields)
    assert {"task", "agent", "nodes", "state", "stop_condition", "rewards", "metrics", "tools"} <= set(
        vf.Trace.model_fields
    )
    assert callable(vf.Trace.stop) and {"messages", "root_reply", "terminated"} <= set(
        inspect.signature(Segment).parameters
    )
    assert {"type", "data", "key", "hash"} <= set(
        TraceTask.model_fields
    ) and "config" in AgentInfo.model_fields
    assert {"handler", "allow_trace"} <= set(inspect.signature(hook_boundary).parameters)
    assert inspect.iscoroutinefunction(call_hook) and callable(state_cls) and callable(concrete_type)
    # Private toolset state plumbing the in-process driver replaces per rollout.
    for attr in ("_pull_state", "_push_state", "register", "setup", "setup_task", "server_name"):
        assert hasattr(ServerBase, attr), attr
    src = inspect.getsource(ServerBase.__init__)
    assert "_state_cls" in src and "_state_adapter" in src
    assert "self._pull_state()" in inspect.getsource(ServerBase._with_state)
    assert "_push_state(before)" in inspect.getsource(ServerBase._with_state)
    assert "_agents" in inspect.getsource(vf.Agents.__init__)
    # The Env protocol primejax serves in process (primejax/envs/verifiers_episode.py, verifiers_ids.py).
    from verifiers.v1.agent import Interaction
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.envs.single_agent import SingleAgentEnv
    from verifiers.v1.interception.server import InterceptionServer

    assert callable(agent_config_fields) and "agents.agent.run(task)" in inspect.getsource(SingleAgentEnv.run)
    assert {"setup", "run", "finalize"} <= set(vars(vf.Env)) and "traces" in vf.Episode.model_fields
    assert {"trace", "turn", "close", "send", "steer"} <= set(vars(Interaction))
    # A tool server's setup_task receives the rollout's TaskData (what the state channel's /task route serves).
    assert "setup_task(task)" in inspect.getsource(ServerBase._setup_task_from_channel)
    assert "session.trace.task.data" in inspect.getsource(InterceptionServer.handle_task_get)


def test_mcp_server_surface():
    from mcp.server.mcpserver import MCPServer

    assert inspect.iscoroutinefunction(MCPServer.list_tools) and inspect.iscoroutinefunction(
        MCPServer.call_tool
    )
    assert list(inspect.signature(MCPServer.call_tool).parameters)[:3] == ["self", "name", "arguments"]


def test_renderers_surface():
    import renderers
    from renderers.base import MODEL_RENDERER_MAP, RENDERER_REGISTRY, _populate_registry
    from renderers.configs import config_from_name

    _populate_registry()
    assert "qwen3" in RENDERER_REGISTRY and isinstance(MODEL_RENDERER_MAP, dict)
    assert "thinking_retention" in type(config_from_name("qwen3")).model_fields
    assert renderers.ToolCallParseStatus.OK == "ok" and callable(renderers.create_renderer)
    proto = renderers.Renderer
    assert {"tools", "add_generation_prompt"} <= set(inspect.signature(proto.render_ids).parameters)
    assert {"tools", "prompt_ids"} <= set(inspect.signature(proto.parse_response).parameters)
    assert "tools" in inspect.signature(proto.bridge_to_next_turn).parameters
    assert {"content", "reasoning_content", "tool_calls"} <= set(
        renderers.ParsedResponse.__dataclass_fields__
    )
    assert {"raw", "name", "arguments", "status", "id"} <= set(renderers.ParsedToolCall.__dataclass_fields__)


def test_verifiers_own_loop_surface():
    """What envs/verifiers_loop.py (the fallback driver) and Env.finalize's caller rely on."""
    import verifiers.v1 as vf
    from verifiers.v1.clients import ModelContext, TrainClientConfig
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.episode import EnvInfo, Episode
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import ModelCall
    from verifiers.v1.utils.loaders import default_harness_id, environment_class

    assert {"renderer", "renderer_model_name", "base_url", "api_key_var"} <= set(
        TrainClientConfig.model_fields
    )
    assert {"model", "client", "sampling"} <= set(inspect.signature(ModelContext).parameters)
    assert list(inspect.signature(vf.Env.run_episode).parameters)[:3] == ["self", "task", "ctx"]
    assert list(inspect.signature(vf.Env.finalize).parameters) == ["self", "task", "episode"]
    assert hasattr(vf.Env, "serving") and hasattr(vf.Task, "NEEDS_CONTAINER")
    assert {"traces", "errors", "ok", "task", "env"} <= set(
        Episode.model_fields
    ) and "id" in EnvInfo.model_fields
    assert {"token_ids", "mask", "logprobs", "sampled", "parent", "message"} <= set(MessageNode.model_fields)
    assert {"node", "finish_reason"} <= set(ModelCall.model_fields)
    assert {"harness", "runtime", "max_turns", "max_output_tokens", "max_total_tokens"} <= set(
        vf.AgentConfig.model_fields
    )
    assert callable(message_to_wire) and callable(agent_config_fields)
    assert default_harness_id("") == "bash" and environment_class("") is vf.SingleAgentEnv


def test_verifiers_env_server_surface():
    """What primejax/envs/env_server.py uses of verifiers' env server (verifiers.v1.serve)."""
    from verifiers.v1.serve import EnvClient, EnvServer

    assert list(inspect.signature(EnvServer).parameters) == ["config", "address", "max_concurrent"]
    assert inspect.iscoroutinefunction(EnvServer.run)
    assert list(inspect.signature(EnvClient.run).parameters)[:6] == [
        "self",
        "client",
        "model",
        "sampling",
        "task_data",
        "on_delta",
    ]
    assert "timeout" in inspect.signature(EnvClient.health).parameters
    assert inspect.iscoroutinefunction(EnvClient.close)
