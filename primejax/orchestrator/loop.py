"""The orchestrator: one step is a pipeline of small stages, in the order a rollout travels.

    dispatch (gate + prompts + groups: env <-> client; finalize_rollout on arrival; finalize_group and the
    pre-batch filters as each group finishes) -> batch cut -> post-batch filters -> samples -> pack -> write

The dispatch mode (dispatch.py: behind a per-step barrier, or a continuous pool) is chosen once from
`orchestrator.pool.mode`; it redoes its generation after an inference outage (outages.py).

`Orchestrator.run()` repeats it for steps start..max_steps, checkpointing every `checkpoint.interval` steps,
while a watcher task keeps the inference server on the newest broadcast weights.

Pre-batch filters run on each group as it finishes; rollouts an *enforcing* pre-batch slot drops are
replaced like groups online difficulty filtering drops (the dispatch generates more), so the batch stays
full. Online evals run in the background next to the following steps' training requests (their metrics join
the first step logged after they finish); a due eval waits only for the previous one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primejax.contracts.batch import TrainingSample, batch_env_names, pack_samples, step_dir, write_batch
from primejax.envs.env_limits import EnvLimits
from primejax.envs.registry import load_env
from primejax.envs.workers import WorkerEnv, in_workers
from primejax.inference.routed_experts import RoutingShape
from primejax.orchestrator import metrics as M
from primejax.orchestrator.algorithms import build_algorithm
from primejax.orchestrator.buffer import POOLS, Buffer, EnvSlot
from primejax.orchestrator.checkpoint import load_checkpoint, save_checkpoint
from primejax.orchestrator.concurrency import AIMDController, AIMDSettings, Limiter, parse_pages
from primejax.orchestrator.config import OrchestratorConfig
from primejax.orchestrator.dispatch import build_dispatch
from primejax.orchestrator.evaluator import build_evaluator
from primejax.orchestrator.failures import FailedSteps
from primejax.orchestrator.filters import build_slots
from primejax.orchestrator.gcpause import GcPolicy
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.looplag import LoopLag
from primejax.orchestrator.outages import OutageCounter, StepRetry
from primejax.orchestrator.policy import PolicyTracker, staleness
from primejax.orchestrator.rollout import Rollout
from primejax.orchestrator.samples import rollout_to_samples
from primejax.orchestrator.token_budget import cut_by_tokens
from primejax.orchestrator.watch import RunWatch
from primejax.rendering.renderer import build_renderer
from primejax.utils.faults import fault_point
from primejax.utils.io import atomic_dir
from primejax.utils.monitor import MonitorConfig

log = logging.getLogger(__name__)
MAX_EMPTY_BATCHES = 5


@dataclass
class StepResult:
    step: int
    rollouts: list[Rollout]  # every rollout generated this step
    batch: list[Rollout]  # the rollouts shipped to the trainer
    samples: list[TrainingSample]
    metrics: dict[str, float] = field(default_factory=dict)
    staleness: list[float] = field(default_factory=list)  # per sample: trainer updates behind its policy


def build_env_slots(o: OrchestratorConfig, **resources: Any) -> list[EnvSlot]:
    """One slot per `orchestrator.envs` entry: the environment and its (possibly overridden) algorithm."""
    slots = []
    for name, entry in o.envs.items():
        env = in_workers(
            load_env(entry.id, dict(entry.args)),
            entry.id,
            dict(entry.args),
            o.env_workers.num,
            o.env_timeout_s,
            name,
        )
        algo = o.env_algo(name)
        algorithm = build_algorithm(algo.type, algo, sampling=o.sampling, **resources)
        slots.append(
            EnvSlot(
                name=name,
                env=env,
                weight=entry.weight,
                algorithm=algorithm,
                limits=EnvLimits(entry.limits, name),
            )
        )
    return slots


def cut_batch(groups: list[list[Rollout]], batch_size: int) -> list[Rollout]:
    """The first `batch_size` trainable rollouts in group order (whole groups first, the last may be split)."""
    batch: list[Rollout] = []
    for group in groups:
        for rollout in group:
            if len(batch) == batch_size:
                return batch
            if rollout.ok and not rollout.dropped:
                batch.append(rollout)
    return batch


class Orchestrator:
    def __init__(
        self,
        o: OrchestratorConfig,
        *,
        client: Any,
        tokenizer: Any,
        run_dir: str | Path,
        seed: int = 0,
        num_shards: int = 1,
        pad_rows_to_multiple: int = 1,
        recovery_timeout_s: float = 600.0,
        monitor: Any = None,
        tracker: PolicyTracker | None = None,
        routing: RoutingShape | None = None,
        watch: MonitorConfig | None = None,
        weights_follower: tuple[str, Any] | None = None,
    ):
        """`num_shards`: trainer processes (one batch file each); `pad_rows_to_multiple`: the trainer's
        micro_batch_size; `recovery_timeout_s`: how long an inference outage may last (a restart included);
        `routing`: the policy's MoE routing shape, when its routed experts are recorded (routing replay);
        `watch`: what to log beside the step metrics (servers' metrics, timeline, samples; None = nothing);
        `weights_follower`: (transport, follower) when the run's weight transport needs the orchestrator to deliver
        its updates (transports/weights/base.Follower)."""
        self.o = o
        self.routing = routing
        self.client = client
        self.run_dir = Path(run_dir)
        self.monitor = monitor
        self.slots = build_env_slots(o, policy_client=client, tokenizer=tokenizer)
        self.buffer = Buffer(self.slots, seed=seed, settings=o.buffer)
        self.tracker = tracker or PolicyTracker(
            client, self.run_dir, poll_interval_s=o.weights_poll_s, follower=weights_follower
        )
        self.outages = OutageCounter(client)
        c = o.concurrency
        # auto starts fixed; `pick_concurrency` (at the start of `run`) switches it to AIMD if the servers allow.
        self.limiter = Limiter(o.max_concurrent if c.mode != "aimd" else (c.initial or c.floor))
        self.generator = GroupGenerator(
            self.outages,
            build_renderer(o.renderer.name, tokenizer),
            o.sampling,
            self.tracker,
            max_concurrent=o.max_concurrent,
            max_prompt_tokens=o.max_prompt_tokens,
            routing=routing,
            max_env_message_chars=o.max_env_message_chars,
            max_abs_reward=o.max_abs_reward,
            env_timeout_s=o.env_timeout_s,
            limiter=self.limiter,
        )
        self.pre_filters, self.post_filters = build_slots(o.filters)
        # Evaluation shares the request limit (and so the servers' capacity) with training.
        self.evaluator = (
            build_evaluator(o, client, self.generator.renderer, self.tracker, limiter=self.limiter)
            if o.eval.interval
            else None
        )
        self.pre_counts: Counter = Counter()  # pre-batch filter flags since the last cut
        # The dispatch mode is chosen here, once; the step below names neither.
        self.dispatch = build_dispatch(
            o,
            run_group=self._group,
            buffer=self.buffer,
            tracker=self.tracker,
            outages=self.outages,
            retry=StepRetry(client, self.tracker, recovery_timeout_s),
            pre_filters=self.pre_filters,
            pre_counts=self.pre_counts,
            client=client,
        )
        self.aimd = self._aimd() if c.mode == "aimd" else None
        self.concurrency_mode = None if c.mode == "auto" else c.mode  # auto: set by pick_concurrency
        self.loop_lag = LoopLag()
        self.watch = None if watch is None else RunWatch(watch, run_dir, client, self.tracker, self.generator)
        self.gc = GcPolicy(freeze=o.gc_freeze, full_every=o.gc_full_every)
        self.num_shards = max(1, num_shards)
        self.pad_rows_to_multiple = pad_rows_to_multiple
        self.next_step = 1
        self.empty_batches = 0
        self.failed_steps = FailedSteps(o.max_failed_steps)
        self.eval_task: asyncio.Task | None = None
        self.last_step_end: float | None = None

    # ------------------------------------------------------------------------------------------ stages

    async def _group(self, env: str, index: int, group_id: int, step: int) -> list[Rollout]:
        slot = self.buffer.envs[env]
        group = await self.generator.group(slot, index, group_id, self.o.group_size, step)
        if group_id == 0:  # the other groups' requests are still in flight
            fault_point("orchestrator.generate", step, run_dir=self.run_dir)
        slot.algorithm.finalize_group(group)
        if not self.buffer.observe_group(env, index, [r.reward for r in group if r.ok]):
            for r in group:
                r.dropped = True
        _, counts = self.pre_filters.apply(group)
        self.pre_counts.update(counts)
        return group

    def to_samples(self, batch: list[Rollout]) -> list[TrainingSample]:
        samples, r = [], self.routing
        env_index = {
            name: i for i, name in enumerate(batch_env_names(self.o.envs))
        }  # the batch's env_ids (contracts.batch)
        for rollout in batch:
            loss_type = self.buffer.envs[rollout.env].algorithm.action_loss_type
            new = rollout_to_samples(
                rollout,
                loss_type,
                self.o.sampling.temperature,
                self.o.seq_len,
                None if r is None else (r.num_layers, r.top_k),
            )
            for sample in new:
                sample.env_index = env_index.get(rollout.env, 0)
            samples += new
        return samples

    def write(self, step: int, samples: list[TrainingSample], meta: dict[str, Any]) -> Path:
        batches = pack_samples(
            samples,
            self.o.seq_len,
            num_shards=self.num_shards,
            pad_rows_to_multiple=self.pad_rows_to_multiple,
            step=step,
            envs=batch_env_names(self.o.envs),
        )
        target = step_dir(self.run_dir, step)
        # The whole step directory appears at once, so the trainer never sees some ranks' files only.
        with atomic_dir(target, overwrite=True) as tmp:
            if self.routing is not None:  # write_batch holds the routed expert ids below it
                meta = {**meta, "num_experts": self.routing.num_experts}
            for rank, batch in enumerate(batches):
                write_batch(tmp, rank, batch, meta)
            fault_point("orchestrator.before_batch_rename", step, path=tmp / "rank_0.npz")
        return target

    async def _server_metrics(self) -> list[dict[str, float] | None]:
        return await asyncio.to_thread(parse_pages, await self.client.metrics_text())

    def _aimd(self) -> AIMDController:
        c, cap = self.o.concurrency, self.o.max_concurrent
        # auto may meet a max_concurrent below the floor (explicit aimd refuses that at start-up): the cap wins.
        settings = AIMDSettings(
            floor=min(c.floor, cap),
            cap=cap,
            increase=c.increase,
            decrease=c.decrease,
            kv_high=c.kv_high,
            waiting_high=c.waiting_high,
            interval_s=c.interval_s,
        )
        return AIMDController(self.limiter, settings, self._server_metrics)

    async def pick_concurrency(self) -> str:
        """`concurrency.mode = auto`: AIMD when a server's /metrics page holds vLLM's load metrics (the names
        `concurrency.parse_prometheus` keeps), fixed at max_concurrent otherwise; said once in the log."""
        if self.concurrency_mode is not None:
            return self.concurrency_mode
        servers: list[dict[str, float] | None] = []
        if hasattr(self.client, "metrics_text"):  # a client of one's own (a test's stand-in) may have none
            try:
                servers = await self._server_metrics()
            except Exception as e:  # noqa: BLE001 - a server that cannot say its load runs at the fixed limit
                log.info("concurrency: /metrics could not be read (%s)", e)
        exposing, total = sum(bool(m) for m in servers), len(servers)
        said = f"fixed at max_concurrent = {self.o.max_concurrent}"
        if exposing:
            self.aimd = self._aimd()
            s = self.aimd.s
            await self.limiter.set_limit(min(self.o.concurrency.initial or s.floor, s.cap))
            said = f"AIMD between {s.floor} and {s.cap} requests"
        log.info(
            "concurrency: %s (%d of %d servers expose vLLM's load metrics on /metrics; concurrency.mode = "
            "auto)",
            said,
            exposing,
            total,
        )
        self.concurrency_mode = "aimd" if exposing else "fixed"
        return self.concurrency_mode

    # ------------------------------------------------------------------------------------------ a step

    async def step(self, step: int) -> StepResult:
        t0 = time.perf_counter()
        server_before = self.generator.stats.server_seconds
        tokens_before = self.generator.stats.completion_tokens
        errors_before = Counter(self.generator.stats.errors)
        cut = await self.dispatch.groups(step)
        groups, waited, gen_seconds = cut.groups, cut.waited, cut.generate_s
        rollouts = [r for g in groups for r in g]
        self.failed_steps.observe(step, rollouts)  # RolloutsFailed: the run stops saying why

        t_post = time.perf_counter()
        pre_counts = Counter(self.pre_counts)  # counted as groups finish; this step's share ends at the cut
        self.pre_counts.clear()
        batch = (
            cut_by_tokens(groups, self.o.batch_tokens, self.o.seq_len)
            if self.o.batch_tokens
            else cut_batch(groups, self.o.batch_size)
        )
        batch, post_counts = self.post_filters.apply(batch)
        offload = self.dispatch.offload  # off the event loop while the dispatch has groups in flight
        samples = await offload(self.to_samples, batch)
        if samples:
            self.empty_batches = 0
        else:
            # An empty batch keeps the trainer in step, but a run that only makes them learns nothing
            # (e.g. group_size 1 under a group-relative algorithm): stop after a few in a row.
            self.empty_batches += 1
            log.warning("step %d: no trainable rollout survived (writing an empty batch)", step)
            if self.empty_batches > MAX_EMPTY_BATCHES:
                raise RuntimeError(
                    f"{self.empty_batches} empty batches in a row: nothing to train on "
                    "(check group_size, rewards and filters)"
                )
        await offload(self.write, step, samples, {"step": step, "policy_version": self.tracker.version})
        post_seconds = time.perf_counter() - t_post
        t_gc = time.perf_counter()
        gc_metrics = self.gc.after_step(step)
        if self.watch is not None:  # on the timeline, back to back, ending now
            self.watch.phases(
                [*cut.phases, ("postprocess", post_seconds), ("gc", time.perf_counter() - t_gc)]
            )

        total = time.perf_counter() - t0
        now = time.perf_counter()
        # Wall time since the previous step finished: what the run pays per step, evals included.
        wall = total if self.last_step_end is None else now - self.last_step_end
        self.last_step_end = now
        completion_tokens = self.generator.stats.completion_tokens - tokens_before
        errors = Counter(self.generator.stats.errors) - errors_before
        server_seconds = self.generator.stats.server_seconds - server_before
        metrics = M.merge(
            M.rollout_metrics(rollouts),
            M.sample_metrics(step, samples),
            M.count_metrics("filters/pre_batch", pre_counts),
            M.count_metrics("filters/post_batch", post_counts),
            M.count_metrics("errors", errors),
            self.buffer.step_metrics(),
            cut.metrics,
            self.loop_lag.take(),
            self._env_worker_metrics(),
            gc_metrics,
            self._server_busy(),
            await self.watch.step_metrics() if self.watch is not None else {},
            {
                "concurrency/limit": self.limiter.limit,
                "concurrency/in_flight_requests": self.limiter.in_flight,
                "batch/rollouts": len(batch),
                "policy/version": self.tracker.version,
                "time/wait_for_weights": waited,
                "time/generate": gen_seconds,
                "time/postprocess": post_seconds,
                "time/step": total,
                "time/step_wall": wall,
                "time/server_request_sum": server_seconds,
                "time/weight_updates_total": self.tracker.update_seconds,
                "weights/collective_updates": self.tracker.collective_updates,
                "weights/failed_transfers": len(self.tracker.failed_offers),
                "perf/rollouts_per_s": len(rollouts) / max(gen_seconds, 1e-9),
                "perf/inference_tokens_per_s": completion_tokens / max(gen_seconds, 1e-9),
            },
        )
        result = StepResult(step=step, rollouts=rollouts, batch=batch, samples=samples, metrics=metrics)
        result.staleness = [float(staleness(step, s.policy_version)) for s in samples]
        return result

    # ------------------------------------------------------------------------------------------ the run

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_step": self.next_step,
            "buffer": self.buffer.state_dict(include_pools=False),
            "policy_version": self.tracker.version,
            **self.dispatch.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_step = int(state["next_step"])
        self.dispatch.load_state_dict(state, self.buffer.envs)
        records = state.get("records", {})
        self.buffer.load_state_dict(state["buffer"], {p: records.get(f"{p}_examples", []) for p in POOLS})
        lifted = self.buffer.lift()  # easy_fraction / hard_fraction re-enter rotation on resume
        if any(lifted.values()):
            log.info("lifted back into rotation: %s", lifted)

    def resume(self, resume_step: str) -> None:
        state = load_checkpoint(self.run_dir, resume_step)
        if state is not None:
            self.load_state_dict(state)
            log.info("resumed orchestrator after step %d", self.next_step - 1)

    def _log(self, result: StepResult) -> None:
        m = result.metrics
        log.info(
            "step %d | reward %.3f | rollouts %d (%d errored) | samples %d | wait %.2fs | step %.2fs | v%d",
            result.step,
            m.get("reward/mean", float("nan")),
            m["rollouts/total"],
            m["rollouts/errored"],
            m["samples/count"],
            m["time/wait_for_weights"],
            m["time/step"],
            m["policy/version"],
        )
        if self.monitor is not None:
            self.monitor.scalars(result.step, m)
            self.monitor.histogram(result.step, "reward", [r.reward for r in result.rollouts if r.ok])
            self.monitor.histogram(result.step, "staleness", result.staleness)
            self.monitor.histogram(
                result.step,
                "advantage",
                [sum(r.advantages) / len(r.advantages) for r in result.batch if r.advantages],
            )

    def _env_worker_metrics(self) -> dict[str, float]:
        workers = [slot.env for slot in self.slots if isinstance(slot.env, WorkerEnv)]
        out = {"env_workers/replaced": float(sum(w.take_replaced() for w in workers))} if workers else {}
        for (
            slot
        ) in self.slots:  # verifiers' env servers (args.driver = "env_server"): lost rollouts, restarts
            if (servers := getattr(slot.env, "servers", None)) is not None and hasattr(
                servers, "take_counts"
            ):
                for key, value in servers.take_counts().items():
                    out[key] = out.get(key, 0.0) + value
        return out

    def _server_busy(self) -> dict[str, float]:
        # A client of one's own (tests' stand-ins, a custom transport) may keep no meter.
        meter = getattr(self.client, "busy", None)
        return meter.take() if meter is not None else {}

    async def close(self) -> None:
        """Close the algorithms' own model clients (frozen teachers / samplers) and what the environments hold
        open (verifiers' serving resources); the policy client is the caller's."""
        for slot in self.slots:
            await slot.algorithm.close()
            if (aclose := getattr(slot.env, "aclose", None)) is not None:  # duck-typed test envs have none
                await aclose()
        for slot in self.evaluator.slots if self.evaluator is not None else []:  # their env workers, if any
            if isinstance(slot.env, WorkerEnv):
                await slot.env.aclose()

    async def run(self, max_steps: int) -> list[dict[str, float]]:
        """Run steps next_step..max_steps; return each step's metrics."""
        await self.pick_concurrency()
        watcher = asyncio.create_task(self.tracker.watch())
        helpers = [asyncio.create_task(self.loop_lag.run())]
        self.gc.start()
        if self.aimd is not None:
            helpers.append(asyncio.create_task(self.aimd.run()))
        history = []
        try:
            helpers += await self.watch.start() if self.watch is not None else []
            # Env workers load their envs before the first rollout (not inside its env_timeout_s); a bad env fails here.
            eval_slots = self.evaluator.slots if self.evaluator is not None else []
            await asyncio.gather(
                *(s.env.pool.start() for s in [*self.slots, *eval_slots] if isinstance(s.env, WorkerEnv))
            )
            while self.next_step <= max_steps:
                result = await self.step(self.next_step)
                if self.eval_task is not None and self.eval_task.done():
                    result.metrics.update(await self._eval_done())
                if self.evaluator is not None and result.step % self.o.eval.interval == 0:
                    if self.eval_task is not None:  # the previous eval is still running: evals never overlap
                        result.metrics.update(await self._eval_done())
                    self.eval_task = asyncio.create_task(self._eval(result.step))
                if self.eval_task is not None and result.step == max_steps:
                    result.metrics.update(await self._eval_done())  # the run's last metrics include its evals
                self._log(result)
                if self.watch is not None:  # the step's timeline and samples
                    await self.watch.log(self.monitor, result.step, result.rollouts, result.batch)
                history.append(result.metrics)
                self.next_step += 1
                interval = self.o.checkpoint.interval  # -1 (unresolved, a section used alone): every step
                if interval and (
                    result.step % interval == 0 or result.step == max_steps
                ):  # the trainer's too
                    records = {f"{p}_examples": self.buffer.pool_records(p) for p in POOLS}
                    save_checkpoint(
                        self.run_dir, result.step, self.state_dict(), self.o.checkpoint.keep, records
                    )
        finally:
            self.gc.stop()
            watcher.cancel()
            for task in helpers:
                task.cancel()
            await self.dispatch.stop()
            pending = [t for t in (watcher, self.eval_task, *helpers) if t is not None]
            if self.eval_task is not None and not self.eval_task.done():
                self.eval_task.cancel()
            self.eval_task = None
            await asyncio.gather(*pending, return_exceptions=True)
        return history

    async def _eval(self, step: int) -> dict[str, float]:
        metrics = await self.evaluator.run(step)
        metrics["eval/step"] = float(step)  # the step after which it started (its policy version)
        return metrics

    async def _eval_done(self) -> dict[str, float]:
        task, self.eval_task = self.eval_task, None
        return await task
