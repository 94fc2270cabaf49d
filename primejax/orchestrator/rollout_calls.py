"""The calls a rollout is made of: model requests and environment calls, each bounded, checked and accounted.

`RolloutCalls` holds what every call needs (the sampling client, the request limiter, the policy version source,
the counters and the timeline) and makes them; `GroupGenerator` (primejax/orchestrator/generate.py) builds its
rollout loops from them.

- A model request waits for a slot of the request limit (evaluation shares training's), is tagged with the
  policy version read when it starts (also noted in the running group's trace,
  primejax/orchestrator/group_trace.py), is counted in `GenerationStats` and timed on the timeline; a reply
  with the wrong number of completions is an error.
- A reply becomes one `TrajectoryStep` only if the server's logprobs and echoed prompt ids match the tokens,
  with the routed experts decoded when routing replay is on (a policy reply without them is an error).
- An environment call is bounded by `orchestrator.env_timeout_s` (tool calls also paced by the env's limits),
  and an environment's messages are cut before anything tokenizes them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from primejax.envs.env_limits import pace_tool_call
from primejax.inference.routed_experts import RoutingShape
from primejax.inference.routed_experts import decode as decode_routed
from primejax.orchestrator.concurrency import Limiter
from primejax.orchestrator.group_trace import note_version
from primejax.orchestrator.message_caps import cap_messages
from primejax.orchestrator.rollout import TrajectoryStep
from primejax.orchestrator.sampling import SamplingConfig
from primejax.orchestrator.timeline import Timeline


class SamplingClient(Protocol):
    async def generate(
        self,
        prompt_token_ids: list[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
    ) -> list[Any]: ...


class VersionSource(Protocol):
    @property
    def version(self) -> int: ...


@dataclass
class GenerationStats:
    """Per-step counters the metrics stage reads."""

    requests: int = 0
    server_seconds: float = 0.0  # summed request latency (overlapping requests add up)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class RolloutCalls:
    """The model requests and environment calls of a generator's rollouts (see the module docstring)."""

    def __init__(
        self,
        client: SamplingClient,
        settings: SamplingConfig,
        policy: VersionSource,
        *,
        limiter: Limiter,
        routing: RoutingShape | None,
        env_timeout_s: float,
        max_env_message_chars: int,
    ):
        """`limiter`: the request limit (may be shared with other generators); `routing`: record the policy's
        routed experts of every sampled token (routing replay); `max_env_message_chars`: the cut of every env
        message before rendering (primejax/orchestrator/message_caps.py)."""
        self.client = client
        self.routing = routing
        self.settings = settings
        self.max_env_message_chars = max_env_message_chars
        self.env_timeout_s = env_timeout_s
        self.policy = policy
        self.semaphore = limiter
        self.stats = GenerationStats()
        self.timeline: Timeline | None = None  # set by the orchestrator when monitor.timeline is on

    async def _request(
        self, prompt_ids: list[int], n: int, seed: int | None, client: SamplingClient | None = None
    ) -> tuple[list[Any], int]:
        s = self.settings
        client = client or self.client
        tl = self.timeline
        queued = tl.clock() if tl is not None else 0.0
        async with self.semaphore:
            # Read the version when the request starts: the gate guarantees it is fresh enough, and a weight
            # update racing the request can only make the served policy newer than the tag.
            version = self.policy.version
            note_version(version)
            start = time.perf_counter()
            if tl is not None:
                began = tl.clock()
                if began - queued > 1e-3:  # it waited for a request slot (orchestrator.max_concurrent / AIMD)
                    tl.add("wait", "request slot", queued, began)
            # Only the policy's own routing is replayed: a frozen sampler's (another model) is not asked for.
            extra = {"routed_experts": True} if self.routing is not None and client is self.client else {}
            completions = None
            try:
                completions = await client.generate(
                    prompt_ids,
                    n=n,
                    max_tokens=s.max_tokens,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    seed=seed,
                    **extra,
                )
            finally:
                if tl is not None:
                    tl.add(
                        "request",
                        "request" if completions is not None else "request (failed)",
                        began,
                        tl.clock(),
                        n=n,
                        prompt_tokens=len(prompt_ids),
                        version=version,
                        completion_tokens=sum(len(c.completion_token_ids) for c in completions or ()),
                    )
            self.stats.server_seconds += time.perf_counter() - start
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt_ids)
        self.stats.completion_tokens += sum(len(c.completion_token_ids) for c in completions)
        if len(completions) != n:
            raise RuntimeError(f"asked for {n} completions, got {len(completions)}")
        return completions, version

    def _step(
        self, prompt_ids: list[int], completion: Any, version: int, sampler: SamplingClient | None = None
    ) -> TrajectoryStep:
        """One trajectory step from a reply; `sampler`: the frozen model that served it (None = the policy)."""
        ids = list(completion.completion_token_ids)
        logprobs = [float(x) for x in completion.completion_logprobs]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"server returned {len(logprobs)} logprobs for {len(ids)} tokens")
        served = getattr(completion, "prompt_token_ids", None)
        if served is not None and list(served) != prompt_ids:
            raise RuntimeError("the server's prompt token ids differ from the ids sent")
        routed = None
        if self.routing is not None and getattr(completion, "routed_experts", None) is not None:
            r = self.routing
            routed = decode_routed(
                completion.routed_experts,
                len(ids),
                r.num_layers,
                r.top_k,
                r.num_experts,
                r.sparse_layers,
                prompt_len=len(prompt_ids),
            )
        elif self.routing is not None and sampler is None:
            raise RuntimeError(
                "orchestrator.routing_replay is on but the server returned no routed_experts "
                "(is inference.return_routed_experts on?)"
            )
        return TrajectoryStep(
            prompt_ids=prompt_ids,
            completion_ids=ids,
            completion_logprobs=logprobs,
            finish_reason=str(completion.finish_reason),
            policy_version=version,
            routed_experts=routed,
        )

    def _seed(self, step: int, group_id: int, turn: int, member: int) -> int | None:
        if self.settings.seed < 0:
            return None
        return (self.settings.seed * 1_000_003 + step * 10_007 + group_id * 101 + turn * 7 + member) % (2**31)

    def _capped(self, messages: Any) -> list[dict[str, Any]]:
        """An environment's messages cut before anything tokenizes them (primejax/orchestrator/message_caps.py)."""
        return cap_messages(messages, self.max_env_message_chars)

    async def _env_call(self, call: Any, what: str) -> Any:
        """An environment call bounded by `orchestrator.env_timeout_s`: a hung one errors its rollout alone."""
        tl = self.timeline
        if what == "env_response":
            await pace_tool_call()  # the env's tool-call rate (its limits.tool_calls_per_s)
        start = tl.clock() if tl is not None else 0.0
        try:
            return await asyncio.wait_for(call, self.env_timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"environment {what} did not answer within {self.env_timeout_s:g} s "
                "(orchestrator.env_timeout_s)"
            ) from None
        finally:
            if tl is not None:
                tl.add("env", what, start, tl.clock())
