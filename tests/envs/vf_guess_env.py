"""A verifiers v1 Env with its own `run`: a scripted user gives hints until the assistant names the word.

The conversation is the env's control flow (`interaction.turn`), as in verifiers' user-sim; the user here is
scripted so tests are deterministic. Pair it with tests/envs/vf_local_taskset.py (tasks carry an `answer`).
"""

from __future__ import annotations

import verifiers.v1 as vf


class GuessEnvConfig(vf.EnvConfig):
    assistant: vf.AgentConfig = vf.AgentConfig()
    rounds: int = 3


class GuessEnv(vf.Env[GuessEnvConfig]):
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


__all__ = ["GuessEnv"]
