"""arithmetic: short `a + b` / `a * b` problems; reward 1 for the exact integer answer, else 0."""

from __future__ import annotations

import re
from typing import Any

from primejax.envs.base import Environment, Example, Message, completion_text, extract_tag, index_rng

SYSTEM_PROMPT = "Solve the arithmetic problem. Give only the final number as the answer."
_INT = re.compile(r"-?\d+")


class Arithmetic(Environment):
    def __init__(
        self,
        max_operand: int = 20,
        ops: str = "+*",
        seed: int = 0,
        num_examples: int = 1_000_000,
        system_prompt: str = SYSTEM_PROMPT,
    ):
        if max_operand < 1 or not ops or set(ops) - set("+-*"):
            raise ValueError(
                f"arithmetic needs max_operand >= 1 and ops from '+-*', got {max_operand}, {ops!r}"
            )
        self.max_operand, self.ops, self.seed = max_operand, ops, seed
        self.num_examples, self.system_prompt = num_examples, system_prompt

    def example(self, index: int) -> Example:
        rng = index_rng(self.seed, index)
        a, b, op = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand), rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        prompt: list[Message] = [{"role": "user", "content": f"{a} {op} {b} ="}]
        if self.system_prompt:
            prompt.insert(0, {"role": "system", "content": self.system_prompt})
        return Example(key=f"arithmetic/{a}{op}{b}", prompt=prompt, answer=value)

    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        reply = completion_text(messages)
        tagged = extract_tag(reply, "answer")
        numbers = _INT.findall(reply if tagged is None else tagged)
        # The last number is the answer: models often restate the problem before answering.
        return float(bool(numbers) and int(numbers[-1]) == example.answer)


def load(**args: Any) -> Arithmetic:
    return Arithmetic(**args)
