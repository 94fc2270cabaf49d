"""Per-rollout cost of driving a verifiers task in process: `python -m tools.bench_vf_driver [--rollouts N]`.

The calculator taskset shipped with the tests, a model that answers instantly from a script (one calculator
call, then the answer), so what is timed is the driver alone: toolset setup and an in-process MCP call,
rendering and bridging with the renderers package, parsing, the three stop kinds, `task.score`. Prints
milliseconds per rollout, sequential and 16 at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass

from primejax.envs.registry import load_env
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.renderer import build_renderer


@dataclass
class Done:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str = "stop"
    text: str = ""


class InstantModel:
    """Turn 1: the right calculator call; turn 2: the answer (read from the prompt's tool result)."""

    def __init__(self, tokenizer, env):
        self.tok, self.env = tokenizer, env
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt_token_ids, *, n, **_):
        text = self.tok.decode(prompt_token_ids)
        if "<tool_response>" in text:
            reply = text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
        else:
            op = "mul" if "product" in text.rsplit("<|im_start|>user", 1)[1] else "add"
            a, b = [int(w) for w in text.replace("?", " ").split() if w.isdigit()][-2:]
            reply = (
                "<tool_call>\n"
                + json.dumps({"name": f"calc_{op}", "arguments": {"a": a, "b": b}})
                + "\n</tool_call>"
            )
        ids = self.tok.encode(reply, add_special_tokens=False) + [self.eos]
        return [Done(list(prompt_token_ids), ids, [-0.1] * len(ids)) for _ in range(n)]


class Version:
    version = 0


class Scorer:
    async def finalize_rollout(self, rollout):
        pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=64)
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    from primejax.models.tiny import build_tokenizer

    with tempfile.TemporaryDirectory() as d:
        build_tokenizer(d, tool_tokens=True)
        tok = AutoTokenizer.from_pretrained(d)
    env = load_env("tests.envs.vf_calc_taskset", {"size": a.rollouts})
    settings = SamplingConfig(max_tokens=128, max_turns=4)
    gen = GroupGenerator(InstantModel(tok, env), build_renderer("auto", tok), settings, Version(),
                         max_concurrent=64, max_prompt_tokens=8192)
    slot = EnvSlot(name="calc", env=env, weight=1.0, algorithm=Scorer())

    async def one(i):
        (r,) = await gen.group(slot, i, i, 1, step=1)
        assert r.error is None and r.num_turns == 2 and r.reward == 1.0, (r.error, r.messages)

    async def sequential():
        times = []
        for i in range(a.rollouts):
            t = time.perf_counter()
            await one(i)
            times.append(time.perf_counter() - t)
        return times

    async def concurrent():
        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(a.rollouts)))
        return time.perf_counter() - t

    asyncio.run(one(0))  # warm-up: imports, tool listing
    seq = asyncio.run(sequential())
    conc = asyncio.run(concurrent())
    print(f"in-process driver, {a.rollouts} rollouts of 2 model calls + 1 tool call, instant model:")
    print(
        f"  sequential: median {1e3 * statistics.median(seq):.1f} ms / rollout (p90 "
        f"{1e3 * sorted(seq)[int(0.9 * len(seq))]:.1f} ms)"
    )
    print(f"  16-64 concurrent: {1e3 * conc / a.rollouts:.1f} ms / rollout (wall / rollouts)")


if __name__ == "__main__":
    main()
