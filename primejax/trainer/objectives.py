"""Registered rl objectives: one signature, and a new objective is one function.

    @register_loss("my_loss")
    def my_loss(inputs: LossInputs, *, scale: float = 1.0) -> LossOutputs: ...

`trainer.loss.type = "my_loss"` (with `trainer.loss.kwargs` as its keyword arguments) then replaces the rl
component of the loss; `default` is the built-in DPPO + KL with the per-env corrections (losses.py). The
function is called once per sequence (packed segment) with `LossInputs` whose arrays span the whole packed row
and whose `loss_mask` selects exactly that sequence's rl tokens; it returns the *sum* of that sequence's
per-token losses (the trainer divides by the step's rl token count) and metrics, which are averaged over the
sequences that have rl tokens and logged as `custom/<name>`. It runs under jit and vmap: jnp ops only, no
boolean indexing (`jnp.where(inputs.loss_mask, x, 0)`).

A function in any importable module can also be named without registering it: `type = "custom"`,
`import_path = "module.function"`. The registry is a plain dict (what tunix's function registry does for its
policy losses and advantage estimators, smaller): the name is the config's value, nothing else is looked up.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

BUILTIN = ("default", "custom")  # trainer.loss.type values that name no registered function


@dataclasses.dataclass
class LossInputs:
    """One sequence's view for an rl objective (arrays of one packed row, [T])."""

    trainer_logprobs: jax.Array
    inference_logprobs: jax.Array
    ref_logprobs: jax.Array | None
    advantages: jax.Array
    loss_mask: jax.Array  # this sequence's rl member tokens
    loss_weights: jax.Array | None  # the rl weight stream (None = 1.0)


@dataclasses.dataclass
class LossOutputs:
    loss: jax.Array  # scalar: the sum of this sequence's per-token losses (normalized by N_rl by the trainer)
    metrics: dict[str, jax.Array]


LossFn = Callable[..., LossOutputs]
_LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Register `fn(inputs: LossInputs, **kwargs) -> LossOutputs` as `trainer.loss.type = name`."""

    def decorate(fn: LossFn) -> LossFn:
        if name in BUILTIN or not name:
            raise ValueError(
                f"trainer.loss.type {name!r} is built in: register the objective under another name"
            )
        if _LOSSES.get(name, fn) is not fn:
            raise ValueError(
                f"an rl objective is already registered as {name!r} ({_LOSSES[name].__qualname__})"
            )
        if not callable(fn):
            raise TypeError(f"register_loss({name!r}) needs a function, got {type(fn).__name__}")
        _LOSSES[name] = fn
        return fn

    return decorate


def registered_losses() -> list[str]:
    return sorted(_LOSSES)


def load_custom_loss(import_path: str) -> LossFn:
    """Import `package.module.function`; a clear error if it does not resolve to a callable."""
    module_name, _, attr = import_path.rpartition(".")
    if not module_name:
        raise ValueError(f"trainer.loss.import_path {import_path!r} must be 'module.function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"trainer.loss.import_path {import_path!r} does not resolve: {e}") from None
    if not callable(fn):
        raise ValueError(f"trainer.loss.import_path {import_path!r} is not callable")
    return fn


def objective(loss_type: str, import_path: str = "") -> LossFn | None:
    """The function `trainer.loss.type` names: None for `default` (losses.py's DPPO + KL), the imported one for
    `custom`, else the registered one (a clear error naming the registered ones if there is none)."""
    if loss_type == "default":
        return None
    if loss_type == "custom":
        return load_custom_loss(import_path)
    if loss_type not in _LOSSES:
        raise ValueError(
            f"trainer.loss.type {loss_type!r} is not a registered rl objective (registered: "
            f"{sorted(_LOSSES)}; built in: {list(BUILTIN)})"
        )
    return _LOSSES[loss_type]


# ------------------------------------------------------------------------------------------ built-in objectives


@register_loss("ppo_clip")
def ppo_clip_loss(inputs: LossInputs, clip_eps: float = 0.2) -> LossOutputs:
    """PPO's clipped surrogate, weighted by the rl weight stream."""
    mask = inputs.loss_mask
    log_ratio = jnp.where(mask, inputs.trainer_logprobs - inputs.inference_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    surrogate = jnp.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
    weights = 1.0 if inputs.loss_weights is None else inputs.loss_weights
    loss = -jnp.sum(jnp.where(mask, weights * surrogate, 0.0))
    n = jnp.maximum(jnp.sum(mask), 1)
    clip_frac = jnp.sum(mask & (ratio != clipped)) / n
    return LossOutputs(loss=loss, metrics={"clip_frac": clip_frac})
