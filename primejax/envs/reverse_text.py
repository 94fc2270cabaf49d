"""reverse-text: reverse a short random lowercase string; reward = LCS ratio to the exact reversal.

As prime-rl's reverse-text environment: the reward is difflib's SequenceMatcher ratio (2·matches / total
length), so partially right answers earn partial credit — a dense signal a tiny model can climb. The answer
is read from `<reversed_text>` tags when the model uses them, else the whole reply counts.
"""

from __future__ import annotations

import difflib
import string
from typing import Any

from primejax.envs.base import Environment, Example, Message, completion_text, extract_tag, index_rng

SYSTEM_PROMPT = "Reverse the text character by character. Put your answer in <reversed_text> tags."


def lcs_ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


class ReverseText(Environment):
    def __init__(
        self,
        min_len: int = 3,
        max_len: int = 6,
        seed: int = 0,
        num_examples: int = 1_000_000,
        system_prompt: str = SYSTEM_PROMPT,
        alphabet: str = string.ascii_lowercase,
    ):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"reverse-text needs 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.min_len, self.max_len, self.seed = min_len, max_len, seed
        self.num_examples = num_examples
        self.system_prompt, self.alphabet = system_prompt, alphabet

    def example(self, index: int) -> Example:
        rng = index_rng(self.seed, index)
        text = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
        prompt: list[Message] = [{"role": "user", "content": text}]
        if self.system_prompt:
            prompt.insert(0, {"role": "system", "content": self.system_prompt})
        return Example(key=f"reverse-text/{text}", prompt=prompt, answer=text[::-1])

    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        reply = completion_text(messages)
        answer = extract_tag(reply, "reversed_text")
        return lcs_ratio(reply.strip() if answer is None else answer, example.answer)


def load(**args: Any) -> ReverseText:
    return ReverseText(**args)
