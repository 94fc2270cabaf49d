"""primejax: asynchronous off-policy RL post-training for LLMs in JAX/Flax."""

__version__ = "0.1.0"
