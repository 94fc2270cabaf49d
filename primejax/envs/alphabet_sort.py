"""alphabet-sort: a multi-turn environment. Sort some names; then more names arrive, re-sort them all.

Turn 1 shows `initial_names` names and asks for them sorted; each later turn adds `names_per_turn` more and
asks for the whole list sorted again, for `num_turns` model turns. The reward averages, over turns, the LCS
ratio between the model's list and the correct one (as prime-rl's alphabet-sort scores each turn), so it is
dense; a turn whose reply has no list scores 0.
"""

from __future__ import annotations

from typing import Any

from primejax.envs.base import Environment, Example, Message, extract_tag, index_rng
from primejax.envs.reverse_text import lcs_ratio

NAMES = (
    "alice",
    "bruno",
    "carla",
    "dmitri",
    "elena",
    "farid",
    "greta",
    "hugo",
    "ines",
    "jonas",
    "kenji",
    "lena",
    "marco",
    "nadia",
    "oscar",
    "petra",
    "quinn",
    "rosa",
    "sven",
    "tara",
    "ugo",
    "vera",
    "walt",
    "xena",
    "yuri",
    "zoe",
)
SYSTEM_PROMPT = (
    "Sort the names alphabetically, one per line, inside <alphabetical_sorted> tags. When more names arrive, "
    "sort all names seen so far."
)
TAG = "alphabetical_sorted"


class AlphabetSort(Environment):
    def __init__(
        self,
        num_turns: int = 2,
        initial_names: int = 3,
        names_per_turn: int = 2,
        seed: int = 0,
        num_examples: int = 1_000_000,
        system_prompt: str = SYSTEM_PROMPT,
    ):
        total = initial_names + (num_turns - 1) * names_per_turn
        if num_turns < 1 or initial_names < 1 or names_per_turn < 1 or total > len(NAMES):
            raise ValueError(f"alphabet-sort: bad sizes (turns {num_turns}, names {total} of {len(NAMES)})")
        self.max_turns = num_turns
        self.initial_names, self.names_per_turn, self.seed = initial_names, names_per_turn, seed
        self.num_examples, self.system_prompt = num_examples, system_prompt

    def _names_by_turn(self, names: list[str]) -> list[list[str]]:
        first = names[: self.initial_names]
        rest = names[self.initial_names :]
        return [first] + [rest[i : i + self.names_per_turn] for i in range(0, len(rest), self.names_per_turn)]

    def example(self, index: int) -> Example:
        rng = index_rng(self.seed, index)
        names = rng.sample(NAMES, self.initial_names + (self.max_turns - 1) * self.names_per_turn)
        turns = self._names_by_turn(names)
        prompt: list[Message] = [{"role": "user", "content": "Sort these names: " + ", ".join(turns[0])}]
        if self.system_prompt:
            prompt.insert(0, {"role": "system", "content": self.system_prompt})
        return Example(key=f"alphabet-sort/{','.join(names)}", prompt=prompt, answer=turns)

    async def env_response(
        self, example: Example, messages: list[Message], state: dict[str, Any]
    ) -> list[Message] | None:
        turn = sum(m["role"] == "assistant" for m in messages)
        if turn >= len(example.answer):
            return None
        return [
            {
                "role": "user",
                "content": "More names: " + ", ".join(example.answer[turn]) + ". Sort all of them.",
            }
        ]

    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        replies = [m.get("content") or "" for m in messages if m["role"] == "assistant"]
        scores, seen = [], []
        for turn, names in enumerate(example.answer):
            seen = seen + list(names)
            reply = replies[turn] if turn < len(replies) else ""
            listed = extract_tag(reply, TAG)
            target = "\n".join(sorted(seen))
            scores.append(0.0 if listed is None else lcs_ratio(listed, target))
        return sum(scores) / len(scores)


def load(**args: Any) -> AlphabetSort:
    return AlphabetSort(**args)
