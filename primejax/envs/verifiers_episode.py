"""verifiers' Env protocol driven in process: `Env.setup(agents)`, `Env.run(task, agents)`, `Env.finalize`.

A verifiers `Env` (a game engine playing the user, a scripted user, self-play seats, a proposer and its
solvers) writes its episode against `Agents`: `agents.<seat>.interaction(task)` (an async context whose
`turn(message)` runs one agent segment and returns a `Segment`, and whose `trace` is the live rollout trace)
and `agents.<seat>.run(task)` (one segment on the task's prompt, returning the finished `Trace`). Here those
objects are primejax's: every model call of every seat goes through the orchestrator (`ModelCall`), and the
traces are verifiers' own `Trace` objects (message graph, rewards, metrics, info, agent name and standing),
scored by their task when their interaction closes, as verifiers' `Interaction.close` does. After `run`,
`finalize(task, episode)` judges across seats over the episode's traces in completion order.

Which seat trains: an env marks seats trainable in its `setup` (verifiers' default: every seat is).
`args.policy_agent` narrows that to named seats (`"player0"`, or `"player0,player1"`); each rollout trains
ONE seat's first run (one trajectory, one reward), the seat rotating over the trainable ones by example index,
so every rollout of a group (one example) trains the same seat and its advantage baseline is per game x seat.
The other seats (and later runs of the trained seat, e.g. a second solver) sample from the same server
without recording training data: self-play against the current policy.
"""

from __future__ import annotations

import contextlib
from typing import Any

from primejax.envs.base import Message, ModelCall
from primejax.envs.verifiers_messages import to_dict, vf_message


def _vf():
    import verifiers.v1 as vf

    return vf


def seat_names(vf_env: Any) -> list[str]:
    """The env's agent seats, in declaration order (the `AgentConfig` fields of its config)."""
    from verifiers.v1.configs.agent import agent_config_fields

    return list(agent_config_fields(vf_env.config))


def parse_policy_agents(value: str, seats: list[str], where: str) -> list[str]:
    """`args.policy_agent` ('' or comma-separated seat names) as a list, every name checked against the seats."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in seats]
    if unknown:
        raise ValueError(
            f"{where}: args.policy_agent names {unknown}, not seats of this env (seats: {seats})"
        )
    return names


def _prompt_messages(data: Any) -> list[Message]:
    out: list[Message] = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        out += [to_dict(m) for m in data.prompt]
    return out


class Interaction:
    """verifiers' `Interaction` (the caller is the run's user) over one in-process world."""

    def __init__(self, episode: Episode, agent: Agent, task: Any, trained: bool):
        self._episode, self._agent, self._task, self.trained = episode, agent, task, trained
        self.world: Any = None  # the adapter's per-rollout world, once open
        self._messages = _prompt_messages(task.data)
        self._sampled = [False] * len(self._messages)
        self._started = self._over = self._done = self._ended = False
        self._calls = 0  # an untrained seat's model calls, capped like the trained seat's (args.max_turns)

    @property
    def trace(self) -> Any:
        return self.world.trace

    async def open(self) -> None:
        self.world = self._episode.driver.world(self._task)
        await self.world.open()
        self.world.name_agent(self._agent.name, self._agent.trainable)
        if self.trained:
            self._episode.policy = self.world
        self.world.sync(self._messages, self._sampled)

    async def turn(self, message: Any = None) -> Any:
        """One user turn (a string or messages; none for a prompted task's opening reply), one agent segment."""
        from verifiers.v1.agent import Segment

        if self._done:
            raise RuntimeError("this interaction is closed")
        if self._over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self._started and self._task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: this exchange takes its next user message")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        self._started = True
        if message is not None:
            new = (
                [{"role": "user", "content": message}]
                if isinstance(message, str)
                else [to_dict(m) for m in message]
            )
            self._messages, self._sampled = self._messages + new, self._sampled + [False] * len(new)
        before = len(self._messages)
        # A limit or stop ended the run after the last reply: this turn reports it, as verifiers' does.
        if self._ended:
            self._over = True
            return Segment(messages=[], terminated=True)
        call = self._episode.model if self.trained else self._untrained
        self._messages, self._sampled, self._ended = await self._episode.driver.segment(
            self.world, self._messages, self._sampled, self._episode.state, call
        )
        if self.trained:
            self._episode.record(self._messages, self._sampled)
        produced = self._messages[before:]
        if not any(self._sampled[before:]):
            self._over = True
            return Segment(messages=[], terminated=True)
        adapter = self.world.message_adapter
        return Segment(messages=[adapter.validate_python(vf_message(m)) for m in produced])

    async def _untrained(self, messages: list[Message], tools: Any = None) -> Message | None:
        if self._calls >= self._episode.driver.max_turns:
            return None
        self._calls += 1
        return await self._episode.model(messages, tools, trainable=False)

    async def send(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "primejax drives verifiers envs turn by turn: use interaction.turn(message)"
        )

    steer = send

    async def close(self, condition: str = "user_closed") -> Any:
        """End the exchange; the trace is scored by its task (verifiers' `Interaction.close`)."""
        if self._done:
            return self.trace
        self._done = True
        trace = self.trace
        self.world.sync(self._messages, self._sampled)
        trace.stop(condition)
        if trace.is_completed and not trace.errors:
            trace.ok = True
        await self.world.close()
        await self.world.task.score(trace)
        self.world.scored = True
        self._episode.finished.append(self.world)
        return trace


class Agent:
    """One seat of one episode: verifiers' `Agent` surface (`interaction`, `run`, `trainable`, `name`)."""

    def __init__(self, episode: Episode, name: str, config: Any):
        self._episode, self.name, self.config, self.trainable = episode, name, config, True

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, *, runtime: Any = None, tools: Any = None, on_trace: Any = None):
        if runtime is not None:
            raise NotImplementedError("primejax's in-process driver has no runtimes to borrow")
        inter = Interaction(self._episode, self, task, self._episode.claim(self))
        await inter.open()
        if on_trace is not None:
            on_trace(inter.trace)
        try:
            yield inter
        except Exception as e:
            inter.trace.record_error(e)
            raise
        finally:
            await inter.close()

    async def run(
        self, task: Any, *, runtime: Any = None, tools: Any = None, on_trace: Any = None, **_: Any
    ) -> Any:
        """One segment on the task's prompt, then the scored trace (verifiers' `Agent.run`)."""
        async with self.interaction(task, runtime=runtime, tools=tools, on_trace=on_trace) as inter:
            await inter.turn()
            inter.trace.stop("agent_completed")
        return inter.trace


class Episode:
    """One episode of a verifiers Env: its agents, which seat trains, its finished traces (completion order)."""

    def __init__(self, driver: Any, state: dict[str, Any], model: ModelCall, seat_index: int):
        self.driver, self.state, self.model = driver, state, model
        self.seat_index = seat_index
        self.finished: list[Any] = []  # the worlds of finished runs
        self.policy: Any = None  # the trained seat's world
        self.messages: list[Message] = []
        self.sampled: list[bool] = []
        self._trained_seat: str | None = None
        self._claimed = False

    def agents(self) -> Any:
        vf = _vf()
        return vf.Agents(self.driver.vf_env.config, lambda name, spec: Agent(self, name, spec))

    def choose_seat(self, agents: Any) -> str:
        """The seat this rollout trains (module docstring); called after the env's `setup`."""
        seats = list(agents._agents)
        wanted = self.driver.policy_agents or seats
        trainable = [n for n in wanted if agents._agents[n].trainable]
        if not trainable:
            raise ValueError(
                f"no trainable seat: args.policy_agent {wanted} and the env's setup left "
                f"{[n for n in seats if agents._agents[n].trainable]} trainable"
            )
        self._trained_seat = trainable[self.seat_index % len(trainable)]
        return self._trained_seat

    def claim(self, agent: Agent) -> bool:
        """Whether this run of `agent` is the rollout's trained one (the trained seat's first run)."""
        if self._claimed or agent.name != self._trained_seat:
            return False
        self._claimed = True
        return True

    def record(self, messages: list[Message], sampled: list[bool]) -> None:
        self.messages, self.sampled = messages, sampled

    @property
    def played(self) -> bool:
        """Whether the trained seat made a model call (a seat may never get a turn: the other forfeited)."""
        return any(self.sampled)

    async def run(self, task: Any) -> list[Message]:
        vf_env = self.driver.vf_env
        agents = self.agents()
        await vf_env.setup(agents)
        self.choose_seat(agents)
        await vf_env.run(task, agents)
        return self.messages

    async def finalize(self, task: Any) -> None:
        """verifiers' end of an episode: `Env.finalize(task, episode)` over every trace in completion order; what
        it records on the trained trace counts in the rollout's reward. A raise fails the rollout."""
        from verifiers.v1.episode import EnvInfo
        from verifiers.v1.episode import Episode as VfEpisode
        from verifiers.v1.trace import TraceTask

        vf_env = self.driver.vf_env
        episode = VfEpisode(
            env=EnvInfo(id=vf_env.config.env_id),
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            traces=[w.trace for w in self.finished],
        )
        await vf_env.finalize(task, episode)
        episode.ok = all(t.ok for t in episode.traces)
