"""A verifiers v1 Env that judges its episode in `finalize` (cross-agent judgement, verifiers' end-of-episode
hook): the scripted guessing game of vf_guess_env.py, plus a reward and metrics recorded over the episode."""

from __future__ import annotations

import verifiers.v1 as vf

from tests.envs.vf_guess_env import GuessEnvConfig


class JudgedGuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        # The word game is the user's side: the seat's task has no prompt (verifiers' user-sim contract), so the
        # first turn(message) opens the exchange.
        seat = type(task)(task.data.model_copy(update={"prompt": None}), task.config)
        async with agents.assistant.interaction(seat) as assistant:
            segment = await assistant.turn("Guess my word.")
            for hint in range(1, self.config.rounds):
                if segment.terminated or task.data.answer in segment.last_reply:
                    break
                segment = await assistant.turn(f"No. It starts with {task.data.answer[:hint]!r}.")

    async def finalize(self, task, episode):
        (trace,) = episode.by_agent["assistant"]
        trace.record_metric("episode_traces", len(episode.traces))
        # verifiers judges each trace by its own task before finalize: the task's rewards are there already.
        trace.record_metric("scored_before_finalize", float("exact" in trace.rewards))
        trace.record_reward("quick", float(trace.num_turns <= 2), weight=2.0)
        if task.data.answer == "stone":
            raise ValueError("finalize refuses stones")


__all__ = ["JudgedGuessEnv"]
