"""Step metrics of the orchestrator, computed from the step's rollouts and samples (pure functions)."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable

from primejax.contracts.batch import TrainingSample
from primejax.orchestrator.policy import staleness
from primejax.orchestrator.rollout import Rollout


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{prefix}/mean": statistics.fmean(values),
        f"{prefix}/std": statistics.pstdev(values),
        f"{prefix}/min": min(values),
        f"{prefix}/max": max(values),
    }


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """Reward (overall and per env), advantage, length and error metrics over every generated rollout,
    filtered or not (filtered rollouts still belong in the distributions)."""
    out: dict[str, float] = {"rollouts/total": len(rollouts)}
    clean = [r for r in rollouts if r.ok]
    out["rollouts/errored"] = len(rollouts) - len(clean)
    out.update(_stats("reward", [r.reward for r in clean]))
    for env in sorted({r.env for r in clean}):
        out.update(
            {
                k.replace("reward/", f"reward/{env}/", 1): v
                for k, v in _stats("reward", [r.reward for r in clean if r.env == env]).items()
            }
        )
    per_rollout_adv = [statistics.fmean(r.advantages) for r in clean if r.advantages]
    out.update(_stats("advantage", per_rollout_adv))
    if per_rollout_adv:
        out["advantage/zero_fraction"] = sum(a == 0.0 for a in per_rollout_adv) / len(per_rollout_adv)
    out.update(_stats("completion_len", [float(r.num_completion_tokens) for r in clean]))
    out.update(_stats("turns", [float(r.num_turns) for r in clean]))
    if clean:
        out["rollouts/truncated_fraction"] = sum(r.truncated for r in clean) / len(clean)
    out.update(tool_metrics(clean))
    out.update(env_signal_metrics(clean))
    return out


def env_signal_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """An environment's own reward components and metrics (verifiers' `trace.rewards` / `trace.metrics`, which
    the adapter puts in `state`), averaged per env: `reward_parts/<env>/<name>`, `env_metrics/<env>/<name>`;
    and the share of each stop condition, `stop/<env>/<condition>`. A rollout lacking a name does not count."""
    out: dict[str, float] = {}
    for env in sorted({r.env for r in rollouts}):
        mine = [r for r in rollouts if r.env == env]
        for key, prefix in (("reward_components", "reward_parts"), ("metrics", "env_metrics")):
            values: dict[str, list[float]] = {}
            for r in mine:
                for name, value in (r.state.get(key) or {}).items():
                    if (
                        isinstance(value, (int, float))
                        and not isinstance(value, bool)
                        and math.isfinite(value)
                    ):
                        values.setdefault(str(name), []).append(float(value))
            out.update({f"{prefix}/{env}/{name}": statistics.fmean(v) for name, v in sorted(values.items())})
        stops = Counter(str(r.state["stop_condition"]) for r in mine if r.state.get("stop_condition"))
        out.update({f"stop/{env}/{cond}": n / len(mine) for cond, n in sorted(stops.items())})
    return out


def tool_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """Share of rollouts with at least one well-formed (parsed) tool call, and with a malformed one; only for
    rollouts of envs that advertise tools (their messages carry a tools-aware parse)."""
    tooled = [r for r in rollouts if "num_malformed_tool_calls" in r.state]
    if not tooled:
        return {}
    good = sum(any(m.get("tool_calls") for m in r.messages if m.get("role") == "assistant") for r in tooled)
    bad = sum(r.state["num_malformed_tool_calls"] > 0 for r in tooled)
    return {"tools/well_formed_fraction": good / len(tooled), "tools/malformed_fraction": bad / len(tooled)}


def sample_metrics(step: int, samples: list[TrainingSample]) -> dict[str, float]:
    out: dict[str, float] = {"samples/count": len(samples)}
    out.update(_stats("seq_len", [float(len(s)) for s in samples]))
    stale = [float(staleness(step, s.policy_version)) for s in samples]
    if stale:
        out["staleness/mean"] = statistics.fmean(stale)
        out["staleness/max"] = max(stale)
        out["policy/min_version"] = min(s.policy_version for s in samples)
    out["samples/loss_tokens"] = sum(sum(s.loss_mask) for s in samples)
    out["samples/tokens"] = sum(len(s) for s in samples)  # what orchestrator.batch_tokens budgets
    return out


def count_metrics(prefix: str, counts: Counter | dict[str, int]) -> dict[str, float]:
    return {f"{prefix}/{name}": float(n) for name, n in counts.items()}


def merge(*parts: Iterable[tuple[str, float]] | dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        out.update(part)
    return out
