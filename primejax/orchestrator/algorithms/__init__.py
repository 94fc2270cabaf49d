"""Algorithms: the base class, the registry, and the built-in algorithms (one module each)."""

from primejax.orchestrator.algorithms import grpo  # noqa: F401  (registers "grpo")
from primejax.orchestrator.algorithms.base import (
    LOSS_TYPES,
    Algorithm,
    algorithm_class,
    build_algorithm,
    register_algorithm,
    registered_algorithms,
)

__all__ = ["LOSS_TYPES", "Algorithm", "algorithm_class", "build_algorithm", "register_algorithm",
           "registered_algorithms"]
