"""Environments: builtin offline tasks, user environments by import path, verifiers tasksets by id."""

from primejax.envs.base import Environment, Example, Message
from primejax.envs.registry import load_env, register_env, registered_envs

__all__ = ["Environment", "Example", "Message", "load_env", "register_env", "registered_envs"]
