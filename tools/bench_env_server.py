"""A tool env's episodes through verifiers' env server vs primejax's env workers: rollouts/s and event-loop lag.

    python -m tools.bench_env_server --episodes 256 --workers 2 --server-max-concurrent 16

Both legs run the calculator taskset of the tests (tests/envs/vf_calc_taskset.py: one calculator tool call,
then the answer, reward 1 checked) against a scripted model that answers instantly (tests/envs/
instant_model.py: in process for the workers' in-process driver, behind vLLM's token-in/token-out route for
verifiers' loop), with every episode started at once through the orchestrator's group generator
(primejax/orchestrator/generate.py) and as many request slots as episodes:
- `workers`: the in-process driver in `--workers` env worker processes (primejax/envs/workers.py);
- `server`: `args.driver = "env_server"`, `--workers` local verifiers env servers (primejax/envs/env_server.py),
  each running at most `--server-max-concurrent` episodes (verifiers' harness program each) at a time.
Timed: rollouts/s over the whole call (the workers / servers started beforehand) and the orchestrator's
event-loop lag (primejax/orchestrator/looplag.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from primejax.envs.registry import load_env  # noqa: E402
from primejax.envs.workers import in_workers  # noqa: E402
from primejax.orchestrator.buffer import EnvSlot  # noqa: E402
from primejax.orchestrator.config import SamplingConfig  # noqa: E402
from primejax.orchestrator.generate import GroupGenerator  # noqa: E402
from primejax.orchestrator.looplag import LoopLag, percentile  # noqa: E402
from primejax.rendering.renderer import build_renderer, load_tokenizer  # noqa: E402
from tests.envs.instant_model import InstantModel, InstantServer  # noqa: E402

TASKSET = "tests.envs.vf_calc_taskset"


class Version:
    version = 0


class NoCredit:
    async def finalize_rollout(self, rollout) -> None:
        return None


async def measure(model_dir: str, leg: str, episodes: int, workers: int, server_max: int,
                  group_size: int = 4) -> dict[str, Any]:  # fmt: skip
    tokenizer = load_tokenizer(model_dir)
    args: dict[str, Any] = {"size": episodes // group_size}
    if leg == "server":
        args.update(driver="env_server", server_workers=workers, server_max_concurrent=server_max)
        env = load_env(TASKSET, args)
    else:
        env = in_workers(load_env(TASKSET, {**args, "driver": "in_process"}), TASKSET,
                         {**args, "driver": "in_process"}, workers, 600.0)  # fmt: skip
    async with InstantServer(InstantModel(tokenizer), model_dir) as server:
        gen = GroupGenerator(server, build_renderer("auto", tokenizer), SamplingConfig(max_tokens=64, max_turns=4),
                             Version(), max_concurrent=episodes, max_prompt_tokens=4096)  # fmt: skip
        slot = EnvSlot(name="calc", env=env, weight=1.0, algorithm=NoCredit())
        try:
            if leg == "server":
                await env.servers.start(4, 600.0)  # starting the servers is not what is timed
            else:
                await env.pool.start()
            lag = LoopLag()
            probe = asyncio.create_task(lag.run())
            start = time.perf_counter()
            groups = await asyncio.gather(*(gen.group(slot, i, i, group_size, 0)
                                            for i in range(episodes // group_size)))  # fmt: skip
            wall = time.perf_counter() - start
            probe.cancel()
        finally:
            await env.aclose()
    rollouts = [r for g in groups for r in g]
    ok = [r for r in rollouts if r.ok and r.reward == 1.0]
    errors = sorted({r.error for r in rollouts if r.error})[:3]
    return {"leg": leg, "workers": workers, "episodes": len(rollouts), "ok": len(ok), "wall_s": round(wall, 2),
            "rollouts_per_s": round(len(ok) / wall, 2), "lag_p50_ms": round(1e3 * percentile(lag.samples, 0.5), 1),
            "lag_p99_ms": round(1e3 * percentile(lag.samples, 0.99), 1),
            "lag_max_ms": round(1e3 * max(lag.samples, default=0.0), 1), "errors": errors}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="env worker processes / local env servers")
    p.add_argument("--server-max-concurrent", type=int, default=16, help="episodes running per env server")
    p.add_argument("--legs", nargs="+", default=["workers", "server"], choices=["workers", "server"])
    p.add_argument("--model-dir", default="", help="a tiny model's directory (default: build one)")
    a = p.parse_args()
    model_dir = a.model_dir
    if not model_dir:
        import tempfile

        from primejax.models.tiny import build_tiny_model

        model_dir = str(
            build_tiny_model(Path(tempfile.mkdtemp()) / "model", tied=True, seed=0, tool_tokens=True)
        )
    rows = [
        asyncio.run(measure(model_dir, leg, a.episodes, a.workers, a.server_max_concurrent)) for leg in a.legs
    ]
    for row in rows:
        print(json.dumps(row))
    print(
        "\n| path | episodes (ok) | rollouts/s | loop lag p50 | p99 | max | wall s |\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(f"| {r['leg']} ({r['workers']}) | {r['episodes']} ({r['ok']}) | {r['rollouts_per_s']} | "
              f"{r['lag_p50_ms']} ms | {r['lag_p99_ms']} ms | {r['lag_max_ms']} ms | {r['wall_s']} |")  # fmt: skip


if __name__ == "__main__":
    main()
