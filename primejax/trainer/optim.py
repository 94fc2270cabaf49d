"""Optimizer and learning-rate schedules: optax AdamW behind global-norm gradient clipping."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import jax
import optax

from primejax.models.transformer import NOT_DECAYED, NOT_TRAINED
from primejax.trainer.config import OptimConfig, SchedulerConfig


def make_schedule(
    lr: float, kind: str = "constant", warmup_steps: int = 0, decay_steps: int = 0, min_lr_ratio: float = 0.0
) -> optax.Schedule:
    """lr as a function of the optimizer step (0-based: the first update uses schedule(0)).

    constant: lr after an optional linear warm-up from 0. linear / cosine: warm-up, then decay to
    lr * min_lr_ratio at `decay_steps` (counted from step 0, so the decay spans decay_steps - warmup_steps).
    """
    floor = lr * min_lr_ratio
    if kind == "constant":
        main = optax.constant_schedule(lr)
    elif kind in ("linear", "cosine"):
        if decay_steps <= warmup_steps:
            raise ValueError(f"decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps})")
        span = decay_steps - warmup_steps
        if kind == "linear":
            main = optax.linear_schedule(lr, floor, span)
        else:
            main = optax.cosine_decay_schedule(lr, span, alpha=min_lr_ratio)
    else:
        raise ValueError(f"unknown schedule {kind!r}")
    if warmup_steps <= 0:
        return main
    # Warm-up starts above 0 so the first update is not a wasted no-op.
    warmup = optax.linear_schedule(lr / (warmup_steps + 1), lr, warmup_steps)
    return optax.join_schedules([warmup, main], [warmup_steps])


def _decay_mask(params: Any) -> Any:
    # Norm scales and biases are not decayed, the usual AdamW practice for transformers; nor are the parameters
    # no step may move (transformer.NOT_TRAINED: their gradient is zero by construction, and decay alone would
    # shrink them). Decided by name, not rank: the layers are stacked, so a norm scale is [layers, hidden] and a
    # q bias [layers, heads, head_dim], as many dimensions as a matrix.
    def decays(path, p) -> bool:
        # the parameter's own name: the last path entry, past the `.value` of an nnx variable's pytree node
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        name = next((n for n in reversed(names) if n and n != "value"), "")
        excluded = name in NOT_TRAINED or name in NOT_DECAYED or name.endswith(("norm", "bias"))
        return getattr(p, "ndim", 0) >= 2 and not excluded

    return jax.tree_util.tree_map_with_path(decays, params)


def optimizer_parts(
    optim: OptimConfig | Mapping[str, Any], schedule: optax.Schedule
) -> tuple[optax.GradientTransformation | None, optax.GradientTransformation]:
    """(global-norm clip or None if max_norm is 0, AdamW): the two stages `make_optimizer` chains. The offloaded
    update (trainer/offload.py) runs them apart: the clip once over all gradients, AdamW bucket by bucket."""
    if isinstance(optim, Mapping):  # unchecked: benchmarks and tests pass plain values (even a NaN lr)
        optim = SimpleNamespace(**optim)
    clip = optax.clip_by_global_norm(optim.max_norm) if optim.max_norm > 0 else None
    adamw = optax.adamw(
        schedule,
        b1=optim.b1,
        b2=optim.b2,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        mask=_decay_mask,
    )
    return clip, adamw


def make_optimizer(
    optim: OptimConfig | Mapping[str, Any], schedule: optax.Schedule
) -> optax.GradientTransformation:
    """Global-norm clip (if max_norm > 0) then AdamW with the given schedule."""
    clip, adamw = optimizer_parts(optim, schedule)
    return optax.chain(*([clip] if clip is not None else []), adamw)


def from_config(
    o: OptimConfig, s: SchedulerConfig, max_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, schedule) from the `trainer.optim` and `trainer.scheduler` sections."""
    schedule = make_schedule(o.lr, s.type, s.warmup_steps, s.total_steps(max_steps), s.min_lr_ratio)
    return make_optimizer(o, schedule), schedule
