"""The JAX trainer: logprobs, losses, the jitted train step, optimizer, checkpoints and weight export."""
