"""Example custom rl losses (`trainer.loss.type = "custom"`, `import_path = "primejax.trainer.custom_losses.X"`).

A custom loss gets one sequence's `LossInputs` (arrays of its packed row; `loss_mask` selects the sequence's
rl tokens) and returns the *sum* of its per-token losses; the trainer divides by the step's rl token count.
"""

from __future__ import annotations

import jax.numpy as jnp

from primejax.trainer.losses import LossInputs, LossOutputs


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
