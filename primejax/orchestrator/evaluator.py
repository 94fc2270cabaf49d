"""Evaluation: every eval env's first `num_examples` examples, `group_size` samples each, under the policy the
inference server serves now. Online (every `orchestrator.eval.interval` steps, between training steps) and
offline (`python -m primejax.eval`).

A rollout passes when its reward is >= `eval.pass_threshold`. Per env: `eval/<env>/reward/{mean,std}`,
`eval/<env>/pass@1` (mean pass rate, the unbiased pass@1 estimate), `eval/<env>/pass@<k>` for k = group_size
> 1 (share of examples with at least one passing sample), `eval/<env>/completion_len/mean`,
`eval/<env>/errored`; and `eval/time`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from primejax.envs.registry import load_env
from primejax.envs.workers import in_workers
from primejax.orchestrator.algorithms import Algorithm
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.concurrency import Limiter
from primejax.orchestrator.config import OrchestratorConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.rollout import Rollout
from primejax.rendering.renderer import Renderer


def eval_slots(o: OrchestratorConfig) -> list[EnvSlot]:
    """`orchestrator.eval.envs`, or the training envs when it is empty; no credit is assigned in evals."""
    entries = o.eval.envs if o.eval.envs else o.envs
    scorer = Algorithm(o.algo)
    return [
        EnvSlot(
            name=name,
            env=in_workers(
                load_env(e.id, dict(e.args)),
                e.id,
                dict(e.args),
                o.env_workers.num,
                o.env_timeout_s,
                f"eval/{name}",
            ),
            weight=e.weight,
            algorithm=scorer,
        )
        for name, e in entries.items()
    ]


def env_metrics(name: str, groups: list[list[Rollout]], threshold: float) -> dict[str, float]:
    rollouts = [r for g in groups for r in g]
    clean = [r for r in rollouts if r.ok]
    p = f"eval/{name}"
    out = {f"{p}/errored": float(len(rollouts) - len(clean)), f"{p}/num_rollouts": float(len(rollouts))}
    if not clean:
        return out
    rewards = [r.reward for r in clean]
    out[f"{p}/reward/mean"] = statistics.fmean(rewards)
    out[f"{p}/reward/std"] = statistics.pstdev(rewards)
    out[f"{p}/completion_len/mean"] = statistics.fmean(r.num_completion_tokens for r in clean)
    per_example = [[r.reward >= threshold for r in g if r.ok] for g in groups]
    per_example = [passes for passes in per_example if passes]
    out[f"{p}/pass@1"] = statistics.fmean(sum(x) / len(x) for x in per_example)
    k = max(len(g) for g in groups)
    if k > 1:
        out[f"{p}/pass@{k}"] = statistics.fmean(any(x) for x in per_example)
    return out


class Evaluator:
    def __init__(
        self,
        slots: list[EnvSlot],
        generator: GroupGenerator,
        *,
        num_examples: int,
        group_size: int,
        pass_threshold: float,
    ):
        self.slots, self.generator = slots, generator
        self.num_examples, self.group_size, self.pass_threshold = num_examples, group_size, pass_threshold

    async def run(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        # Scored against the policy served when it started (a rollout's turns may be newer, never older).
        out: dict[str, float] = {"eval/policy_version": float(self.generator.policy.version)}
        for slot in self.slots:
            n = (
                self.num_examples
                if slot.env.num_examples is None
                else min(self.num_examples, slot.env.num_examples)
            )
            groups = await asyncio.gather(
                *(self.generator.group(slot, i, i, self.group_size, step) for i in range(n))
            )
            out.update(env_metrics(slot.name, list(groups), self.pass_threshold))
        out["eval/time"] = time.perf_counter() - start
        return out


def build_evaluator(
    o: OrchestratorConfig, client: Any, renderer: Renderer, policy: Any, limiter: Limiter | None = None
) -> Evaluator:
    """An evaluator with its own generator (its request counters stay out of the training metrics); `limiter`:
    the training generator's request limit, shared so evals and training rollouts fill one pool of requests."""
    generator = GroupGenerator(
        client,
        renderer,
        o.sampling,
        policy,
        max_concurrent=o.max_concurrent,
        max_prompt_tokens=o.max_prompt_tokens,
        limiter=limiter,
        max_env_message_chars=o.max_env_message_chars,
    )
    return Evaluator(
        eval_slots(o),
        generator,
        num_examples=o.eval.num_examples,
        group_size=o.eval.group_size,
        pass_threshold=o.eval.pass_threshold,
    )
