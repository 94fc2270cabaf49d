"""reverse-text scored by an LLM judge (primejax/envs/judge.py): the judge is asked to grade the reply 0-9 and
the first digit of its answer / 9 is the reward (0 when it gives none). Loaded as
`tests.envs.judged_reverse:load` with `judge = {...}` (a JudgeConfig) among its args."""

from __future__ import annotations

import re
from typing import Any

from primejax.envs.base import completion_text
from primejax.envs.judge import Judge
from primejax.envs.reverse_text import ReverseText

PROMPT = "Text: {text}\nReply: {reply}\nIs the reply the text reversed? Grade it with one digit 0-9."


def verdict(text: str) -> float:
    found = re.search(r"[0-9]", text)
    return int(found.group()) / 9 if found else 0.0


class JudgedReverse(ReverseText):
    def __init__(self, judge: dict[str, Any], **args: Any):
        super().__init__(**args)
        self.judge = Judge(judge)

    async def score(self, example, messages, state) -> float:
        reply = completion_text(messages)
        state["judge_reply"] = await self.judge.complete(
            [{"role": "user", "content": PROMPT.format(text=example.answer[::-1], reply=reply)}]
        )
        return verdict(state["judge_reply"])


def load(**args: Any) -> JudgedReverse:
    return JudgedReverse(**args)
