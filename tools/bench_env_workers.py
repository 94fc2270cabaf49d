"""A CPU-heavy reward in process vs in env worker processes: event-loop lag and samples/s.

    python -m tools.bench_env_workers --burn-ms 200 --rollouts 64 --workers 0 2

The orchestrator's own group generator (rendering, the request limit, trajectory steps, scoring through the env,
primejax/orchestrator/generate.py) drives reverse-text rollouts whose `score` burns `--burn-ms` of CPU (a busy
loop, as a heavy verifier would). The model is a scripted stand-in answering instantly, so what is timed is the
orchestrator and the env: samples/s over the whole run, and the event-loop lag (primejax/orchestrator/looplag.py:
how late a 50 ms timer fires), which is what every in-flight request and weight poll would suffer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from primejax.envs.reverse_text import ReverseText  # noqa: E402
from primejax.envs.workers import in_workers  # noqa: E402
from primejax.orchestrator.buffer import EnvSlot  # noqa: E402
from primejax.orchestrator.config import SamplingConfig  # noqa: E402
from primejax.orchestrator.generate import GroupGenerator  # noqa: E402
from primejax.orchestrator.looplag import LoopLag, percentile  # noqa: E402
from primejax.rendering.renderer import build_renderer, load_tokenizer  # noqa: E402

ENV_ID = "tools.bench_env_workers:load"


class BurningReverse(ReverseText):
    """reverse-text whose reward first burns `burn_ms` of this process's CPU."""

    def __init__(self, burn_ms: float = 200.0, **kw: Any):
        super().__init__(**kw)
        self.burn_s = burn_ms / 1000

    async def score(self, example, messages, state) -> float:
        end = time.process_time() + self.burn_s
        while time.process_time() < end:
            pass
        return await super().score(example, messages, state)


def load(**args: Any) -> BurningReverse:
    return BurningReverse(**args)


@dataclass
class Reply:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str = "stop"
    text: str = ""


class InstantModel:
    """A scripted stand-in server: every request answered at once with the same few tokens."""

    def __init__(self, tokenizer: Any):
        self.ids = tokenizer.encode("abc", add_special_tokens=False) + [
            tokenizer.convert_tokens_to_ids("<|im_end|>")
        ]

    async def generate(self, prompt_token_ids, *, n, **_: Any):
        await asyncio.sleep(0)
        return [Reply(list(prompt_token_ids), list(self.ids), [-0.1] * len(self.ids)) for _ in range(n)]


class Version:
    version = 0


class NoCredit:
    async def finalize_rollout(self, rollout) -> None:
        return None


async def measure(
    tokenizer: Any, workers: int, burn_ms: float, rollouts: int, group_size: int
) -> dict[str, Any]:
    args = {"burn_ms": burn_ms}
    env = in_workers(load(**args), ENV_ID, args, workers, 600.0, "burn")
    if workers:
        await env.pool.start()  # loading the env in the workers is not what is timed
    slot = EnvSlot(name="burn", env=env, weight=1.0, algorithm=NoCredit())
    gen = GroupGenerator(InstantModel(tokenizer), build_renderer("auto", tokenizer), SamplingConfig(max_tokens=16),
                         Version(), max_concurrent=64, max_prompt_tokens=128)  # fmt: skip
    lag = LoopLag()
    probe = asyncio.create_task(lag.run())
    start = time.perf_counter()
    groups = await asyncio.gather(
        *(gen.group(slot, i, i, group_size, 0) for i in range(rollouts // group_size))
    )
    wall = time.perf_counter() - start
    probe.cancel()
    if workers:
        await env.aclose()
    done = [r for g in groups for r in g if r.ok]
    return {"workers": workers, "burn_ms": burn_ms, "finished": len(done), "wall_s": wall,
            "samples_per_s": len(done) / wall, "lag_p50_ms": 1e3 * percentile(lag.samples, 0.5),
            "lag_p99_ms": 1e3 * percentile(lag.samples, 0.99), "lag_max_ms": 1e3 * max(lag.samples, default=0.0)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--burn-ms", type=float, default=200.0)
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = p.parse_args()
    from primejax.models.tiny import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer(Path(tmp))
        tokenizer = load_tokenizer(tmp)
        rows = [
            asyncio.run(measure(tokenizer, w, args.burn_ms, args.rollouts, args.group_size))
            for w in args.workers
        ]
    for row in rows:
        print(json.dumps(row))
    print("\n| env_workers | samples/s | loop lag p50 | p99 | max | wall s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['samples_per_s']:.1f} | {r['lag_p50_ms']:.0f} ms | {r['lag_p99_ms']:.0f} ms | "
              f"{r['lag_max_ms']:.0f} ms | {r['wall_s']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
