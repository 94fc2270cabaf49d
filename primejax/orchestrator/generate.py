"""Groups of rollouts: the environment <-> inference client loop, with bounded concurrency.

A group's first turn is one request with `n = group_size` (the prompt is shared, so the server prefills it
once); each rollout then continues alone through its later turns. A limiter bounds the requests in flight.
Each rollout is handed to `algorithm.finalize_rollout` as soon as it is scored, before its siblings finish.
The single model requests and environment calls the loops below are built from (bounded, checked, counted)
are `RolloutCalls` (primejax/orchestrator/rollout_calls.py).

The policy's client serves every request unless the env's algorithm samples from a frozen model
(`algorithm.sampling_client`, e.g. sft's teacher).

Environments that run their own episode loop (`drives_rollout`, e.g. verifiers tasks with tools or an
`Env.run`) get a `ModelCall` per rollout instead: every model call still goes through here (render or bridge,
request, one trajectory step, structured parse), the group's shared first request included when the env's
first prompt is the example's. Tool calls the renderer could not parse are counted
(`errors/malformed_tool_call`) and handed to the env in `state["malformed_tool_calls"]` for that turn.

Environments that sample through a client of their own (`samples_itself`: verifiers' own rollout loop, a
harness program per rollout) get the server's endpoint and the sampling settings, and hand back each model
call's exact ids and logprobs as the server returned them; every turn is tagged with the policy version read
when the rollout started (a weight update during it can only make later turns newer).

Failure isolation: an exception from the environment (follow-up turn or scoring) or from a later-turn request
fails that rollout only (`rollout.error`, logged and counted). A failed first request fails its group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import numbers
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from primejax.envs.base import Endpoint
from primejax.envs.env_clock import EnvClock
from primejax.inference.client import sticky_route
from primejax.inference.routed_experts import RoutingShape
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.concurrency import Limiter
from primejax.orchestrator.group_trace import note_version
from primejax.orchestrator.message_caps import auto_limit, check_tools
from primejax.orchestrator.rollout import Rollout, TrajectoryStep
from primejax.orchestrator.rollout_calls import RolloutCalls, SamplingClient, VersionSource
from primejax.orchestrator.sampling import SamplingConfig
from primejax.orchestrator.timeline import TRACK
from primejax.rendering.renderer import Renderer, parse_message

log = logging.getLogger(__name__)


def checked_reward(value: Any, max_abs: float = 1e6) -> float:
    """An environment's reward as a float; ValueError for a non-numeric (a string, a bool), non-finite or out of
    range (|reward| > `max_abs`, `orchestrator.max_abs_reward`) one, so that rollout is errored instead of
    turning its group's advantages into NaN or overflowing float32 (a finite 1e308 does)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"reward must be a real number, got {type(value).__name__} {value!r}")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward must be finite, got {reward}")
    if abs(reward) > max_abs:
        raise ValueError(
            f"reward must be within [-{max_abs:g}, {max_abs:g}] (orchestrator.max_abs_reward), got {reward:g}"
        )
    return reward


@dataclass
class _Stage:
    """Where a rollout is (request, env, score, algorithm): names the error count when it fails."""

    name: str


def _sampler(slot: EnvSlot) -> SamplingClient | None:
    return getattr(slot.algorithm, "sampling_client", None)


class GroupGenerator(RolloutCalls):
    def __init__(
        self,
        client: SamplingClient,
        renderer: Renderer,
        settings: SamplingConfig,
        policy: VersionSource,
        *,
        max_concurrent: int,
        max_prompt_tokens: int,
        routing: RoutingShape | None = None,
        max_abs_reward: float = 1e6,
        env_timeout_s: float = 600.0,
        limiter: Limiter | None = None,
        max_env_message_chars: int = 0,
    ):
        """`routing`: record the policy's routed experts of every sampled token (routing replay); `limiter`: a
        request limit shared with other generators (evaluation shares training's), else `max_concurrent`;
        `max_env_message_chars`: the cut of every env message before rendering (0 = from max_prompt_tokens,
        primejax/orchestrator/message_caps.py)."""
        super().__init__(
            client,
            settings,
            policy,
            limiter=limiter or Limiter(max_concurrent),
            routing=routing,
            env_timeout_s=env_timeout_s,
            max_env_message_chars=max_env_message_chars or auto_limit(max_prompt_tokens),
        )
        self.renderer = renderer
        self.max_prompt_tokens = max_prompt_tokens
        self.max_abs_reward = max_abs_reward

    def _max_turns(self, slot: EnvSlot) -> int:
        """Model calls one rollout may make: the env's own cap and orchestrator.sampling.max_turns."""
        return max(1, min(slot.env.max_turns, self.settings.max_turns))

    async def group(
        self, slot: EnvSlot, index: int, group_id: int, group_size: int, step: int
    ) -> list[Rollout]:
        sticky_route()  # every turn of this group's rollouts on the server its first request goes to
        TRACK.set(("groups", f"group {group_id}"))  # this group task's work, on the timeline
        example = slot.env.example(index)
        try:
            prompt = self._capped(example.prompt)
        except ValueError as e:
            prompt, error = [], f"env: ValueError: {e}"
        else:
            error = None
        rollouts = [
            Rollout(
                env=slot.name,
                example_index=index,
                example=example,
                group_id=group_id,
                messages=[dict(m) for m in prompt],
            )
            for _ in range(group_size)
        ]
        if error is not None:
            log.warning("group %d (%s #%d) failed: %s", group_id, slot.name, index, error)
            for r in rollouts:
                r.error = error
                self.stats.count_error("env")
            return rollouts
        if slot.env.samples_itself:
            await asyncio.gather(
                *(self._sampled_by_env(slot, r, step, member) for member, r in enumerate(rollouts))
            )
            return rollouts
        if slot.env.drives_rollout and not example.prompt:  # the env opens the conversation itself
            await asyncio.gather(
                *(self._drive(slot, r, None, step, member) for member, r in enumerate(rollouts))
            )
            return rollouts
        try:
            tools = check_tools(
                await self._env_call(slot.env.tools(example), "tools"), self.max_env_message_chars
            )
            prompt_ids = self.renderer.render_ids(prompt, tools)
            if len(prompt_ids) > self.max_prompt_tokens:
                raise ValueError(f"prompt has {len(prompt_ids)} tokens > max_prompt_tokens")
            completions, version = await self._request(
                prompt_ids, group_size, self._seed(step, group_id, 0, 0), _sampler(slot)
            )
        except Exception as e:  # noqa: BLE001 - a failed group must not take the step down
            log.warning("group %d (%s #%d) failed on its first request: %s", group_id, slot.name, index, e)
            for r in rollouts:
                r.error = f"request: {type(e).__name__}: {e}"
                self.stats.count_error("request")
            return rollouts
        if slot.env.drives_rollout:
            await asyncio.gather(
                *(
                    self._drive(slot, r, (prompt_ids, c, version), step, member)
                    for member, (r, c) in enumerate(zip(rollouts, completions, strict=True))
                )
            )
            return rollouts
        await asyncio.gather(
            *(
                self._finish(slot, r, prompt_ids, c, version, step, member)
                for member, (r, c) in enumerate(zip(rollouts, completions, strict=True))
            )
        )
        return rollouts

    async def _settle(
        self, slot: EnvSlot, rollout: Rollout, stage: _Stage, play: Callable[[], Awaitable[None]]
    ) -> None:
        """Run a rollout's turns (`play`, which keeps `stage` current), then score it and let the algorithm
        finish it. Any failure errors this rollout alone, counted under the stage it happened in."""
        try:
            async with slot.limits.episode() if slot.limits is not None else contextlib.nullcontext():
                await play()  # under the env's own limits (primejax/envs/env_limits.py)
            if not rollout.steps:
                raise RuntimeError("the environment finished without calling the model")
            rollout.truncated = rollout.truncated or rollout.steps[-1].finish_reason == "length"
            stage.name = "score"
            rollout.reward = checked_reward(
                await self._env_call(
                    slot.env.score(rollout.example, rollout.messages, rollout.state), "score"
                ),
                self.max_abs_reward,
            )
            stage.name = "algorithm"
            await slot.algorithm.finalize_rollout(rollout)
        except Exception as e:  # noqa: BLE001 - one bad rollout fails alone
            rollout.error = f"{stage.name}: {type(e).__name__}: {e}"
            rollout.reward = None
            self.stats.count_error(stage.name)
            log.warning(
                "rollout failed at %s (%s #%d): %s\n%s",
                stage.name,
                slot.name,
                rollout.example_index,
                e,
                traceback.format_exc(limit=3),
            )
        finally:
            if (forget := getattr(slot.env, "forget", None)) is not None:  # an env in workers drops its state
                forget(rollout.state)

    async def _finish(
        self,
        slot: EnvSlot,
        rollout: Rollout,
        prompt_ids: list[int],
        completion: Any,
        version: int,
        step: int,
        member: int,
    ) -> None:
        """An orchestrator-driven rollout: model turns alternate with the env's `env_response`."""
        TRACK.set(("groups", f"group {rollout.group_id} · {member}"))
        stage = _Stage("request")

        async def play() -> None:
            nonlocal prompt_ids, completion, version
            max_turns = self._max_turns(slot)
            while True:
                rollout.steps.append(self._step(prompt_ids, completion, version, _sampler(slot)))
                message, _ = parse_message(self.renderer, rollout.steps[-1].completion_ids, prompt_ids)
                rollout.messages.append(message)
                if len(rollout.steps) >= max_turns:
                    break
                stage.name = "env"
                new = await self._env_call(
                    slot.env.env_response(rollout.example, rollout.messages, rollout.state), "env_response"
                )
                if not new:
                    break
                new = self._capped(new)
                rollout.messages.extend(new)
                last = rollout.steps[-1]
                prompt_ids = self.renderer.bridge_to_next_turn(
                    last.prompt_ids, last.completion_ids, new
                ) or self.renderer.render_ids(rollout.messages)
                if len(prompt_ids) > self.max_prompt_tokens:
                    rollout.truncated = True
                    break
                stage.name = "request"
                seed = self._seed(step, rollout.group_id, len(rollout.steps), member)
                (completion,), version = await self._request(prompt_ids, 1, seed, _sampler(slot))

        await self._settle(slot, rollout, stage, play)

    async def _sampled_by_env(self, slot: EnvSlot, rollout: Rollout, step: int, member: int) -> None:
        """A rollout sampled by the environment's own client (`samples_itself`, see module docstring)."""
        TRACK.set(("groups", f"group {rollout.group_id} · {member}"))
        s = self.settings
        stage = _Stage("env")

        async def play() -> None:
            if self.routing is not None:
                raise RuntimeError(
                    "orchestrator.routing_replay needs the routed experts of every call: drive this "
                    "env in process (args.driver = 'in_process')"
                )
            client = _sampler(slot) or self.client
            base_url, model = await client.openai_endpoint()
            endpoint = Endpoint(
                base_url=base_url,
                model=model,
                renderer=self.renderer,
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                max_turns=self._max_turns(slot),
                seed=self._seed(step, rollout.group_id, 0, member),
                env_timeout_s=self.env_timeout_s,
                api_key_var=getattr(client, "api_key_var", ""),
            )
            async with self.semaphore:
                version = self.policy.version
                note_version(version)
                start = self.timeline.clock() if self.timeline is not None else 0.0
                sampled = await slot.env.sample_rollout(rollout.example, rollout.state, endpoint)
                if self.timeline is not None:  # the env's own loop: its requests and tools are one span
                    self.timeline.add(
                        "request",
                        "sampled by the env",
                        start,
                        self.timeline.clock(),
                        turns=len(sampled.turns),
                        version=version,
                    )
            for turn in sampled.turns:
                if len(turn.completion_logprobs) != len(turn.completion_ids):
                    raise RuntimeError(
                        f"{len(turn.completion_logprobs)} logprobs for {len(turn.completion_ids)} tokens"
                    )
                rollout.steps.append(
                    TrajectoryStep(
                        prompt_ids=list(turn.prompt_ids),
                        completion_ids=list(turn.completion_ids),
                        completion_logprobs=[float(x) for x in turn.completion_logprobs],
                        finish_reason=turn.finish_reason,
                        policy_version=version,
                    )
                )
                self.stats.requests += 1
                self.stats.prompt_tokens += len(turn.prompt_ids)
                self.stats.completion_tokens += len(turn.completion_ids)
            rollout.messages = list(sampled.messages)

        await self._settle(slot, rollout, stage, play)

    async def _drive(
        self,
        slot: EnvSlot,
        rollout: Rollout,
        first: tuple[list[int], Any, int] | None,
        step: int,
        member: int,
    ) -> None:
        """An env-driven rollout: the env's loop calls the model through `call` (see module docstring)."""
        TRACK.set(("groups", f"group {rollout.group_id} · {member}"))
        max_turns = self._max_turns(slot)
        pending = [first]  # the group's shared first completion, used when the env's first prompt matches
        stage = _Stage("env")

        async def call(
            messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None = None,
            *,
            trainable: bool = True,
        ) -> dict[str, Any] | None:
            messages = self._capped(messages)
            tools = check_tools(tools, self.max_env_message_chars)
            if not trainable:
                ids = self.renderer.render_ids(messages, tools)
                (completion,), _ = await self._request(ids, 1, None, _sampler(slot))
                message, _ = parse_message(self.renderer, list(completion.completion_token_ids), ids, tools)
                return message
            if len(rollout.steps) >= max_turns:
                rollout.truncated = True
                return None
            known = len(rollout.messages)
            last = rollout.steps[-1] if rollout.steps else None
            prompt_ids = None
            if last is not None and messages[:known] == rollout.messages:
                prompt_ids = self.renderer.bridge_to_next_turn(
                    last.prompt_ids, last.completion_ids, messages[known:], tools
                )
            prompt_ids = prompt_ids or self.renderer.render_ids(messages, tools)
            if len(prompt_ids) > self.max_prompt_tokens:
                rollout.truncated = True
                return None
            stage.name = "request"
            if pending[0] is not None and not rollout.steps and pending[0][0] == prompt_ids:
                _, completion, version = pending[0]
            else:
                seed = self._seed(step, rollout.group_id, len(rollout.steps), member)
                (completion,), version = await self._request(prompt_ids, 1, seed, _sampler(slot))
            pending[0] = None
            rollout.steps.append(self._step(prompt_ids, completion, version, _sampler(slot)))
            message, malformed = parse_message(
                self.renderer, rollout.steps[-1].completion_ids, prompt_ids, tools
            )
            for _ in malformed:
                self.stats.count_error("malformed_tool_call")
            rollout.state["malformed_tool_calls"] = malformed
            rollout.state["num_malformed_tool_calls"] = rollout.state.get(
                "num_malformed_tool_calls", 0
            ) + len(malformed)
            rollout.messages = [*messages, message]
            rollout.state["output_tokens"] = rollout.num_completion_tokens
            rollout.state["total_tokens"] = len(prompt_ids) + len(rollout.steps[-1].completion_ids)
            stage.name = "env"
            return message

        # The env's own code (its setup, steps between turns, scoring on close) runs under env_timeout_s; the
        # clock stops during the model calls it makes back (primejax/envs/env_clock.py).
        clock = EnvClock(self.env_timeout_s, repr(slot.name))
        tl = self.timeline
        env_since = [tl.clock() if tl is not None else 0.0]  # when the env's own code last took over

        def env_worked() -> None:
            """On the timeline: the env's code since it last had control (`tool` after a tool call)."""
            if tl is not None:
                last = rollout.messages[-1] if rollout.steps and rollout.messages else {}
                tl.add("env", "tool" if last.get("tool_calls") else "env", env_since[0], tl.clock())

        async def timed_call(
            messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None = None,
            *,
            trainable: bool = True,
        ) -> dict[str, Any] | None:
            env_worked()
            try:
                with clock.paused():
                    return await call(messages, tools, trainable=trainable)
            finally:
                env_since[0] = tl.clock() if tl is not None else 0.0

        async def play() -> None:
            try:
                rollout.messages = self._capped(
                    await clock.run(slot.env.rollout(rollout.example, rollout.state, timed_call))
                )
            finally:
                env_worked()

        await self._settle(slot, rollout, stage, play)
