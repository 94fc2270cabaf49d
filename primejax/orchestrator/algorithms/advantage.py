"""Shared credit math and reference-scoring helpers of the algorithms (plain functions, no state).

Advantages are registered functions (docs/algorithms.md#registered-advantages), one signature: a function of
one group that returns one advantage per rollout. It sees the group's clean rollouts (full trajectories,
messages, example info) and the scores after any length penalty:

    @register_advantage("my_advantage")
    def my_advantage(inputs: AdvantageInputs, *, eps: float = 1e-8) -> AdvantageOutputs | list[float]: ...

`orchestrator.algo.advantage.name = "my_advantage"` (keyword arguments from `advantage.kwargs`) then credits
the grpo family's groups (an env may name its own: `orchestrator.envs.<name>.algo.advantage`); grpo's own
is `group_relative`, max_rl's `mean_normalized`. A function in any importable module can also be named
without registering it: `advantage.import_path = "module.function"` (or "module:function").
"""

from __future__ import annotations

import importlib
import math
import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from primejax.orchestrator.rollout import Rollout, TrajectoryStep


@dataclass
class AdvantageInputs:
    rollouts: list[Rollout]  # the group's clean rollouts (errored ones never reach credit assignment)
    scores: list[float]  # reward minus the algorithm's length penalty, one per rollout

    @property
    def rewards(self) -> list[float]:
        return [float(r.reward) for r in self.rollouts]


@dataclass
class AdvantageOutputs:
    advantages: list[float]  # one per rollout, broadcast over its sampled tokens


AdvantageFn = Callable[[AdvantageInputs], "AdvantageOutputs | Sequence[float]"]


def group_relative(scores: list[float]) -> list[float]:
    """DR-GRPO credit: score minus the group mean; fewer than two scores have no baseline (zero credit)."""
    if len(scores) < 2:
        return [0.0] * len(scores)
    mean = statistics.fmean(scores)
    return [s - mean for s in scores]


def mean_normalized(scores: list[float]) -> list[float]:
    """MaxRL credit: (s - mean) / mean, zero when the group mean is <= 0 (no success to learn from)."""
    if len(scores) < 2:
        return [0.0] * len(scores)
    mean = statistics.fmean(scores)
    if mean <= 0.0:
        return [0.0] * len(scores)
    return [(s - mean) / mean for s in scores]


def import_object(path: str) -> object:
    """`module.attr` or `module:attr` -> the object."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ImportError(f"{path!r} is not an import path 'module.function'")
    obj = getattr(importlib.import_module(module), attr, None)
    if obj is None:
        raise ImportError(f"{module} has no attribute {attr!r}")
    return obj


_ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register `fn(inputs: AdvantageInputs, **kwargs)` as `algo.advantage.name = name`."""

    def decorate(fn: AdvantageFn) -> AdvantageFn:
        if not name:
            raise ValueError("an advantage needs a name")
        if _ADVANTAGES.get(name, fn) is not fn:
            raise ValueError(
                f"an advantage is already registered as {name!r} ({_ADVANTAGES[name].__qualname__})"
            )
        if not callable(fn):
            raise TypeError(f"register_advantage({name!r}) needs a function, got {type(fn).__name__}")
        _ADVANTAGES[name] = fn
        return fn

    return decorate


def registered_advantages() -> list[str]:
    return sorted(_ADVANTAGES)


@register_advantage("group_relative")
def group_relative_advantage(inputs: AdvantageInputs) -> list[float]:
    """grpo's credit (DR-GRPO): `group_relative` of the scores."""
    return group_relative(inputs.scores)


@register_advantage("mean_normalized")
def mean_normalized_advantage(inputs: AdvantageInputs) -> list[float]:
    """max_rl's credit (MaxRL): `mean_normalized` of the scores."""
    return mean_normalized(inputs.scores)


def bind_advantage(
    fn: AdvantageFn, kwargs: Mapping[str, Any] | None, label: str
) -> Callable[[AdvantageInputs], list[float]]:
    """`fn` bound to its kwargs and checked to return one finite value per rollout."""
    kwargs = dict(kwargs or {})

    def advantage(inputs: AdvantageInputs) -> list[float]:
        out = fn(inputs, **kwargs)
        values = out.advantages if isinstance(out, AdvantageOutputs) else out
        values = [float(v) for v in values]
        if len(values) != len(inputs.rollouts):
            raise ValueError(
                f"advantage {label} returned {len(values)} values for {len(inputs.rollouts)} rollouts"
            )
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"advantage {label} returned a non-finite value: {values}")
        return values

    return advantage


def load_advantage_fn(
    import_path: str, kwargs: Mapping[str, Any] | None = None
) -> Callable[[AdvantageInputs], list[float]]:
    """The function at `import_path`, bound (`bind_advantage`)."""
    fn = import_object(import_path)
    if not callable(fn):
        raise TypeError(f"custom advantage {import_path!r} is not callable")
    return bind_advantage(fn, kwargs, repr(import_path))


def registered_advantage(
    name: str, kwargs: Mapping[str, Any] | None = None
) -> Callable[[AdvantageInputs], list[float]]:
    """The advantage registered as `name`, bound (`bind_advantage`)."""
    if name not in _ADVANTAGES:
        raise KeyError(f"advantage {name!r} is not registered (registered: {registered_advantages()})")
    return bind_advantage(_ADVANTAGES[name], kwargs, repr(name))


# ------------------------------------------------------------------------------------ reference scoring


def extension_runs(steps: list[TrajectoryStep]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Group a trajectory's steps the way interleaving merges them (the extension property,
    docs/architecture.md#multi-turn-trajectories).

    Returns, per run, the run's full token context (last prompt + its completion) and, for each step of the
    run, (start, length) of that step's sampled tokens inside the context. Causality makes one forward pass
    over the longest context score every step of the run in its own context.
    """
    runs: list[tuple[list[int], list[tuple[int, int]]]] = []
    for step in steps:
        context = runs[-1][0] if runs else None
        if context is None or not (
            len(step.prompt_ids) >= len(context) and step.prompt_ids[: len(context)] == context
        ):
            runs.append(([], []))
        spans = runs[-1][1]
        spans.append((len(step.prompt_ids), len(step.completion_ids)))
        runs[-1] = (list(step.prompt_ids) + list(step.completion_ids), spans)
    return runs


ScoreFn = Callable[[list[int]], Awaitable[list]]


async def reference_logprobs(rollout: Rollout, score: ScoreFn, hint_ids: Sequence[int] = ()) -> list[float]:
    """Per sampled token (all steps concatenated), its logprob under `score`'s model, in the sample's own
    context optionally preceded by `hint_ids` (opsd's demonstration block; its logprobs are sliced off)."""
    out: list[float] = []
    hint = list(hint_ids)
    for context, spans in extension_runs(rollout.steps):
        scored = (await score(hint + context))[len(hint) :]
        if len(scored) != len(context):
            raise RuntimeError(f"reference scored {len(scored)} positions of a {len(context)}-token context")
        for start, n in spans:
            values = scored[start : start + n]
            if any(v is None for v in values):
                raise RuntimeError("reference returned no logprob for a sampled token")
            out += [float(v) for v in values]
    return out
