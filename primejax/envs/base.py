"""What the orchestrator needs from an environment: examples, follow-up turns, and a reward.

An environment is addressed by example *index*: `example(i)` must return the same example for the same `i`
on every call and in every process. That makes the prompt source's state (an RNG and, later, the difficulty
pools) a handful of integers that checkpoint as JSON, and lets generated environments (reverse-text,
arithmetic) be infinite without materializing anything.

Messages are plain OpenAI-style dicts (`{"role": ..., "content": ...}`), rendered to token ids by the
orchestrator with the policy's chat template.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

from primejax.rendering.messages import Message  # the renderers speak it too


class ModelCall(Protocol):
    """The orchestrator's model, handed to environments that run their own episode loop (`drives_rollout`).

    `await model(messages, tools)` renders the conversation (bridging from the previous call's ids when
    `messages` extends it), samples one completion under the orchestrator's control (token ids, logprobs,
    policy version recorded as a trajectory step) and returns it parsed into an assistant message (content,
    reasoning_content, tool_calls). It returns None when the orchestrator's caps end the rollout (turns,
    prompt length). `trainable=False` samples without recording a step (an untrained agent, e.g. a
    simulated user)."""

    async def __call__(
        self, messages: list[Message], tools: list[dict[str, Any]] | None = None, *, trainable: bool = True
    ) -> Message | None: ...


@dataclass(frozen=True)
class Example:
    """One prompt of an environment. `key` identifies it across runs (difficulty pools, logs)."""

    key: str
    prompt: list[Message]
    answer: Any = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Endpoint:
    """Where a `samples_itself` environment sends its model calls, and how (the orchestrator's settings)."""

    base_url: str  # the OpenAI-compatible server root (no /v1)
    model: str  # the served model's name (its path when served from a local directory)
    renderer: Any  # the orchestrator's renderer (its family and settings)
    max_tokens: int
    temperature: float
    top_p: float
    max_turns: int
    seed: int | None = None
    # orchestrator.env_timeout_s: bounds the env's own stages (task setup, scoring, finalize), not model calls
    env_timeout_s: float | None = None
    # the environment variable holding the server's API key (orchestrator.client.api_key_env); '' = none
    api_key_var: str = ""


@dataclass
class SampledTurn:
    """One model call of a rollout sampled by the environment's own client: the exact ids the server saw and
    returned, and the sampling logprobs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str = "stop"


@dataclass
class SampledRollout:
    messages: list[Message]
    turns: list[SampledTurn]


class Environment(ABC):
    """Base class of every environment the orchestrator can drive.

    Single-turn environments implement `example` and `score`. Multi-turn ones also override `env_response`,
    which the rollout loop calls after each model turn until it returns None or `max_turns` model calls were
    made. `state` is a per-rollout dict the environment may use freely (it starts empty).
    """

    #: Number of distinct examples; None = unbounded (generated from the index).
    num_examples: int | None = None
    #: Model calls per rollout this environment wants at most; the orchestrator also caps it by
    #: `orchestrator.sampling.max_turns`.
    max_turns: int = 1
    #: True when the environment runs its own episode loop (`rollout`) and calls the model through a
    #: `ModelCall`; otherwise the orchestrator alternates model turns and `env_response`.
    drives_rollout: bool = False
    #: True when the environment samples through a client of its own against the orchestrator's server
    #: (verifiers' own rollout loop): the orchestrator hands it the endpoint (`sample_rollout`) and receives
    #: the finished model calls' exact ids and logprobs, as the server returned them.
    samples_itself: bool = False
    #: True when the environment's own code (tools, env_response, scoring, an episode) burns enough CPU to
    #: stall the orchestrator's event loop: with `orchestrator.env_workers.num = -1` (auto, the default) it
    #: runs in worker processes sized to the machine (docs/rollouts.md#environment-workers-orchestratorenv_workers).
    cpu_heavy: bool = False

    async def tools(self, example: Example) -> list[dict[str, Any]] | None:
        """Tool schemas advertised on the example's first prompt (OpenAI function format), or None."""
        return None

    async def rollout(self, example: Example, state: dict[str, Any], model: ModelCall) -> list[Message]:
        """Run one episode (only for `drives_rollout` environments); returns the full conversation."""
        raise NotImplementedError(f"{type(self).__name__} does not drive its own rollouts")

    async def sample_rollout(
        self, example: Example, state: dict[str, Any], endpoint: Endpoint
    ) -> SampledRollout:
        """Run one episode through the environment's own client (only for `samples_itself` environments).
        `score` is called afterwards as for any rollout (an env whose loop scored the episode returns that)."""
        raise NotImplementedError(f"{type(self).__name__} does not sample its own rollouts")

    async def aclose(self) -> None:
        """Release what the environment holds open (servers, subprocesses); called when the run ends."""
        return None

    @abstractmethod
    def example(self, index: int) -> Example:
        """The example at `index` (deterministic)."""

    async def env_response(
        self, example: Example, messages: list[Message], state: dict[str, Any]
    ) -> list[Message] | None:
        """New messages after the model's last turn (`messages[-1]`), or None when the episode is over."""
        return None

    @abstractmethod
    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        """The rollout's reward from the full conversation (prompt, model turns, environment turns)."""


def index_rng(seed: int, index: int) -> random.Random:
    """A private RNG per example, so example(i) depends on nothing but (seed, i)."""
    return random.Random(seed * 1_000_003 + index)


def completion_text(messages: list[Message]) -> str:
    """The last assistant message's text ('' if there is none)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""


def extract_tag(text: str, tag: str) -> str | None:
    """The text inside the last `<tag>...</tag>` (an unclosed final tag counts up to the end), or None."""
    start = text.rfind(f"<{tag}>")
    if start < 0:
        return None
    body = text[start + len(tag) + 2 :]
    end = body.find(f"</{tag}>")
    return (body if end < 0 else body[:end]).strip()
