"""Fleet simulator: the real orchestrator (primejax.orchestrator.loop.Orchestrator: buffer, generator, pool,
algorithm, filters, packing, batch files, policy tracker) against M simulated inference servers, a long-tailed
multi-turn environment and a trainer stand-in, barrier (`pool.mode=step`) vs continuous in the same run.

What is simulated (the cost model's parameters are the `Cost` and `Workload` defaults; docs/rollouts.md):
- a server: continuous batching in iterations of `chunk` decode tokens; an iteration takes
  `chunk * (decode_base_s + decode_per_seq_s * running)` plus `prefill_s_per_token` for every context token
  (re)admitted in it; at most `max_seqs` sequences run; their KV (context + generated tokens) must fit
  `kv_tokens`; when growth overflows it, the newest sequence is preempted (back to the queue head, its context
  prefilled again on readmission). A weight update pauses the server `update_s`.
- the environment: lognormal turns per rollout, output tokens per turn and tool latency (env_response sleeps).
- the trainer: waits for rollouts/step_n, takes `step_s`, publishes broadcasts/step_n.
Everything else is the real code. Time: `--clock virtual` (default) runs the asyncio loop on simulated time
(timers jump ahead when nothing is ready), so the orchestrator's own CPU time is free and the figures are the
scheduling policy's; `--clock real --scale s` runs on the wall clock with every simulated second lasting `s`
seconds, which is how the event-loop lag at 10,000 in-flight rollouts is measured (the simulated servers share
the loop, so their bookkeeping counts against the lag too).

    python tools/bench_fleet.py                      # M = 1, 4, 16: barrier vs continuous (virtual time)
    python tools/bench_fleet.py --lag                # 10,000 rollouts in flight on the wall clock: loop lag
    python tools/bench_fleet.py --servers 1 --steps 3  # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from primejax.config import default_config, typed  # noqa: E402
from primejax.contracts.batch import step_dir  # noqa: E402
from primejax.envs.base import Environment, Example  # noqa: E402
from primejax.envs.registry import register_env  # noqa: E402
from primejax.orchestrator.loop import Orchestrator  # noqa: E402
from primejax.orchestrator.policy import PolicyTracker  # noqa: E402
from primejax.transports.weights.filesystem.broadcast import write_broadcast  # noqa: E402


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time: when no callback is ready and no thread job runs, time jumps to the next
    timer. (Relies on CPython's `_ready` / `_scheduled` loop internals; a benchmark tool, not library code.)"""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        self._threads = 0  # executor jobs running (asyncio.to_thread): time stands still until they end

    def time(self) -> float:
        return self._now

    def run_in_executor(self, executor, func, *args):
        fut = super().run_in_executor(executor, func, *args)
        self._threads += 1
        fut.add_done_callback(self._thread_done)
        return fut

    def _thread_done(self, _fut) -> None:
        self._threads -= 1

    def _run_once(self) -> None:
        if not self._ready and self._scheduled and not self._threads:
            self._now = max(self._now, self._scheduled[0]._when)
        super()._run_once()


@dataclass
class Cost:
    """A vLLM-like server (roughly an 8B model on one H100: ~16 ms per decode step at 64 sequences)."""

    max_seqs: int = 64
    kv_tokens: int = 48_000
    chunk: int = 8  # decode tokens per simulated iteration
    decode_base_s: float = 0.010
    decode_per_seq_s: float = 0.0001
    prefill_s_per_token: float = 0.00005
    prompt_overhead: int = 512  # system prompt / tool schemas: context tokens on top of the real prompt ids
    update_s: float = 0.5


@dataclass
class Workload:
    """A long-tailed agentic task (lognormal: median, sigma)."""

    turns: tuple[float, float] = (2.0, 0.8)
    max_turns: int = 6
    output_tokens: tuple[float, float] = (120.0, 1.0)
    max_tokens: int = 512
    tool_s: tuple[float, float] = (2.0, 1.2)
    max_tool_s: float = 60.0
    tool_tokens: int = 16  # tokens in a tool result message (its text)


def lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


@dataclass
class Seq:
    ctx: int  # tokens to prefill on admission (prompt, plus what was generated before a preemption)
    target: int
    done_fut: asyncio.Future
    generated: int = 0


@dataclass
class SimServer:
    cost: Cost
    clock: Any
    scale: float
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    kv: int = 0
    busy_s: float = 0.0  # time with at least one sequence running
    occupied_s: float = 0.0  # time x running / max_seqs (the batch's fill)
    preemptions: int = 0
    pause_s: float = 0.0
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    async def run(self) -> None:
        c = self.cost
        while True:
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
            prefill = 0
            while (
                self.waiting
                and len(self.running) < c.max_seqs
                and self.kv + self.waiting[0].ctx + c.chunk <= c.kv_tokens
            ):
                seq = self.waiting.popleft()
                prefill += seq.ctx
                self.kv += seq.ctx
                self.running.append(seq)
            if not self.running:  # one sequence larger than the whole cache: run it alone anyway
                seq = self.waiting.popleft()
                prefill, self.kv = seq.ctx, self.kv + seq.ctx
                self.running.append(seq)
            dt = (
                self.pause_s
                + prefill * c.prefill_s_per_token
                + c.chunk * (c.decode_base_s + c.decode_per_seq_s * len(self.running))
            )
            self.pause_s = 0.0
            await asyncio.sleep(dt * self.scale)
            self.busy_s += dt
            self.occupied_s += dt * len(self.running) / c.max_seqs
            still = []
            for seq in self.running:
                step = min(c.chunk, seq.target - seq.generated)
                seq.generated += step
                self.kv += step
                if seq.generated >= seq.target or seq.done_fut.cancelled():
                    self.kv -= seq.ctx + seq.generated
                    if not seq.done_fut.done():
                        seq.done_fut.set_result(seq.generated)
                else:
                    still.append(seq)
            self.running = still
            while self.kv > c.kv_tokens and len(self.running) > 1:  # preempt the newest: recomputed later
                seq = self.running.pop()
                self.kv -= seq.ctx + seq.generated
                seq.ctx += seq.generated
                seq.target -= seq.generated
                seq.generated = 0
                self.waiting.appendleft(seq)
                self.preemptions += 1

    async def decode(self, ctx: int, target: int) -> int:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(Seq(ctx=ctx, target=target, done_fut=fut))
        self.wake.set()
        try:
            return await fut
        except (
            asyncio.CancelledError
        ):  # the client went away: vLLM aborts; here the sequence ends on its next step
            fut.cancel()
            raise


@dataclass
class Completion:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str
    text: str = ""


class SimClient:
    """The orchestrator's client over the simulated servers: least-loaded placement, sticky per rollout turn
    is not modelled (no prefix cache); weight updates reach every server."""

    def __init__(self, servers: list[SimServer], work: Workload, token: int, eos: int, seed: int):
        self.servers, self.work, self.token, self.eos = servers, work, token, eos
        self.rng = random.Random(seed)
        self.version = 0

    async def generate(
        self, prompt_token_ids, *, n, max_tokens, temperature, top_p=1.0, stop=None, seed=None, **_: Any
    ):
        server = min(self.servers, key=SimServer.load)
        ctx = len(prompt_token_ids) + server.cost.prompt_overhead
        lengths = [
            max(1, min(max_tokens, round(lognormal(self.rng, *self.work.output_tokens)))) for _ in range(n)
        ]
        done = await asyncio.gather(*(server.decode(ctx if i == 0 else 0, t) for i, t in enumerate(lengths)))
        out = []
        for t in done:
            ids = [self.token] * (t - 1) + [self.eos]
            out.append(
                Completion(list(prompt_token_ids), ids, [-1.0] * t, "length" if t >= max_tokens else "stop")
            )
        return out

    async def update_weights(self, weight_dir: str, version: int) -> None:
        for s in self.servers:
            s.pause_s += s.cost.update_s
        self.version = version

    async def weights_version(self) -> int:
        return self.version

    async def reload_weights(self) -> None:
        self.version = 0

    async def metrics_text(self) -> list[str]:
        return [
            f"vllm:kv_cache_usage_perc {s.kv / s.cost.kv_tokens}\nvllm:num_requests_waiting {len(s.waiting)}\n"
            f"vllm:num_preemptions_total {s.preemptions}\n"
            for s in self.servers
        ]

    async def wait_ready(self, timeout_s: float) -> None:
        return None


class LongTailEnv(Environment):
    """Multi-turn: each rollout makes a lognormal number of model calls, a tool call (lognormal latency) after
    each but the last; reward is random in [0, 1]."""

    num_examples = 1_000_000

    def __init__(self, work: Workload, scale: float, seed: int = 0):
        self.work, self.scale, self.seed = work, scale, seed
        self.max_turns = work.max_turns

    def example(self, index: int) -> Example:
        rng = random.Random(self.seed * 1_000_003 + index)
        return Example(
            key=f"sim/{index}",
            prompt=[{"role": "user", "content": f"task {index}"}],
            info={"rng": rng.random()},
        )

    async def env_response(self, example, messages, state):
        rng = state.setdefault("rng", random.Random(random.random()))
        turns = state.setdefault("turns", min(self.work.max_turns, 1 + int(lognormal(rng, *self.work.turns))))
        state["calls"] = state.get("calls", 0) + 1
        if state["calls"] >= turns:
            return None
        await asyncio.sleep(min(self.work.max_tool_s, lognormal(rng, *self.work.tool_s)) * self.scale)
        return [{"role": "user", "content": "x" * self.work.tool_tokens}]

    async def score(self, example, messages, state) -> float:
        return random.random()


class Recorder:
    """A monitor: the loop time at each logged step and every staleness value."""

    def __init__(self, clock):
        self.clock, self.step_time, self.metrics, self.staleness = clock, {}, {}, []

    def scalars(self, step, values):
        self.step_time[step] = self.clock()
        self.metrics[step] = dict(values)

    def histogram(self, step, name, values):
        if name == "staleness":
            self.staleness += list(values)

    def text(self, *a):
        pass


async def trainer(run_dir: Path, steps: int, step_s: float, scale: float, clock, idle: list[float]) -> None:
    for n in range(1, steps + 1):
        start = clock()
        while not step_dir(run_dir, n).exists():
            await asyncio.sleep(0.05 * scale)
        if n > 1:  # before the first batch every trainer waits
            idle.append(clock() - start)
        await asyncio.sleep(step_s * scale)
        write_broadcast(run_dir, n, lambda d, n=n: _fake_weights(d, n))


def _fake_weights(d: Path, n: int) -> None:
    """The least a broadcast must hold (the STABLE manifest check wants a .safetensors file)."""
    (d / "config.json").write_text(json.dumps({"step": n}))
    save_file({"step": np.full((1,), n, np.float32)}, str(d / "model.safetensors"))


def orchestrator_config(run_dir: Path, mode: str, servers: int, args: argparse.Namespace, work: Workload):
    cfg = default_config()
    cfg.run.output_dir, cfg.run.name = str(run_dir.parent), run_dir.name
    o = cfg.orchestrator
    o.envs.reverse_text.id = "sim-longtail"
    o.group_size = args.group_size
    o.batch_size = args.rollouts_per_server * servers
    o.async_level = args.async_level
    o.seq_len, o.max_prompt_tokens = 8192, 3072
    cfg.inference.max_model_len = 8192
    cfg.model.path = "unused"  # no model: the servers are simulated
    o.sampling.max_tokens, o.sampling.max_turns = work.max_tokens, work.max_turns
    o.max_concurrent = args.max_concurrent or Cost().max_seqs * servers  # what the fleet can run at once
    o.filters.pre_batch, o.filters.post_batch = (), ()
    o.weights_poll_s = 0.2 * args.scale if args.clock == "real" else 0.2
    o.pool.mode = mode
    o.concurrency.mode = args.concurrency
    o.pool.groups_in_flight = args.in_flight // args.group_size  # 0: the pool's default, 2 x batch
    o.gc_freeze = not args.no_gc_freeze
    return typed(cfg).orchestrator


async def run_one(
    mode: str, servers: int, args: argparse.Namespace, tokenizer, workdir: Path
) -> dict[str, float]:
    random.seed(servers)  # the environment's draws (the client has its own generator): same workload per mode
    loop = asyncio.get_running_loop()
    clock = loop.time
    scale = args.scale if args.clock == "real" else 1.0
    work = Workload()
    fleet = [SimServer(Cost(), clock, scale) for _ in range(servers)]
    tasks = [asyncio.create_task(s.run()) for s in fleet]
    register_env("sim-longtail", lambda **_: LongTailEnv(work, scale))
    run_dir = workdir / f"{mode}-{servers}"
    o = orchestrator_config(run_dir, mode, servers, args, work)
    client = SimClient(
        fleet,
        work,
        tokenizer.convert_tokens_to_ids("a"),
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        seed=servers,
    )
    tracker = PolicyTracker(client, run_dir, poll_interval_s=o.weights_poll_s, clock=clock)
    recorder = Recorder(clock)
    orch = Orchestrator(
        o, client=client, tokenizer=tokenizer, run_dir=run_dir, tracker=tracker, monitor=recorder
    )
    idle: list[float] = []
    start = clock()
    await asyncio.gather(orch.run(args.steps), trainer(run_dir, args.steps, args.step_s, scale, clock, idle))
    for t in tasks:
        t.cancel()
    t1, tn = recorder.step_time[1], recorder.step_time[args.steps]
    span = (tn - t1) / scale
    samples = sum(recorder.metrics[n]["samples/count"] for n in range(2, args.steps + 1))
    lags = [m.get("loop_lag/p99", 0.0) for m in recorder.metrics.values()]
    return {
        "samples_per_s": samples / max(span, 1e-9),
        "busy": statistics.fmean(s.busy_s for s in fleet) / ((clock() - start) / scale),
        "occupancy": statistics.fmean(s.occupied_s for s in fleet) / ((clock() - start) / scale),
        "trainer_idle": sum(idle) / scale / max(span, 1e-9),
        "staleness_mean": statistics.fmean(recorder.staleness) if recorder.staleness else 0.0,
        "staleness_hist": {k: recorder.staleness.count(k) for k in sorted(set(recorder.staleness))},
        "cancelled": sum(
            m.get("pool/cancelled_stale", 0) + m.get("pool/dropped_stale", 0)
            for m in recorder.metrics.values()
        ),
        "preemptions": sum(s.preemptions for s in fleet),
        "max_in_flight": max(m["concurrency/in_flight_requests"] for m in recorder.metrics.values()),
        # Only meaningful on the wall clock: on virtual time the probe's sleeps do not take real time.
        "loop_lag_p99_ms": 1000 * max(lags) if args.clock == "real" else float("nan"),
        "loop_lag_p99_by_step_ms": [round(1000 * x, 1) for x in lags] if args.clock == "real" else [],
        "sim_s": span,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--modes", nargs="+", default=["step", "continuous"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rollouts-per-server", type=int, default=64, help="batch_size = this x servers")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--async-level", type=int, default=1)
    p.add_argument("--step-s", type=float, default=4.0, help="simulated trainer step time")
    p.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help="continuous: rollouts in the pool; 0 = the pool's default (2 x batch)",
    )
    p.add_argument(
        "--max-concurrent", type=int, default=0, help="request limit; 0 = the fleet's max_seqs x M"
    )
    p.add_argument(
        "--concurrency",
        choices=("fixed", "aimd", "auto"),
        default="fixed",
        help="orchestrator.concurrency.mode (the figures in docs/benchmarks.md: fixed at --max-concurrent)",
    )
    p.add_argument("--clock", choices=("virtual", "real"), default="virtual")
    p.add_argument("--scale", type=float, default=0.05, help="real clock: wall seconds per simulated second")
    p.add_argument(
        "--lag", action="store_true", help="10,000 rollouts in flight on the wall clock (16 servers)"
    )
    p.add_argument("--no-gc-freeze", action="store_true", help="orchestrator.gc_freeze=False (the baseline)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    if args.lag:
        args.clock, args.servers, args.modes = "real", [16], ["continuous"]
        args.rollouts_per_server, args.in_flight, args.max_concurrent = 160, 10_000, 10_000
        args.steps = min(args.steps, 4)

    from primejax.models.tiny import build_tokenizer
    from primejax.orchestrator.renderer import load_tokenizer

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer(Path(tmp) / "tok")
        tokenizer = load_tokenizer(str(Path(tmp) / "tok"))
        for servers in args.servers:
            for mode in args.modes:
                loop = VirtualTimeLoop() if args.clock == "virtual" else asyncio.new_event_loop()
                wall = time.perf_counter()
                try:
                    r = loop.run_until_complete(run_one(mode, servers, args, tokenizer, Path(tmp)))
                finally:
                    loop.close()
                r.update(servers=servers, mode=mode, wall_s=time.perf_counter() - wall)
                results.append(r)
                print(json.dumps(r), flush=True)
    print(
        "\n| M | mode | samples/s | server busy | batch fill | trainer idle | staleness mean | stale cancelled | "
        "preemptions | peak requests | loop lag p99 (ms) | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = {r["servers"]: r["samples_per_s"] for r in results if r["mode"] == "step"}
    for r in results:
        ratio = (
            f" ({r['samples_per_s'] / base[r['servers']]:.2f}x)"
            if r["servers"] in base and r["mode"] != "step"
            else ""
        )
        print(
            f"| {r['servers']} | {r['mode']} | {r['samples_per_s']:.1f}{ratio} | {r['busy']:.0%} | {r['occupancy']:.0%} | "
            f"{r['trainer_idle']:.0%} | {r['staleness_mean']:.2f} | {r['cancelled']:.0f} | {r['preemptions']} | "
            f"{r['max_in_flight']:.0f} | {r['loop_lag_p99_ms']:.1f} | {r['wall_s']:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
