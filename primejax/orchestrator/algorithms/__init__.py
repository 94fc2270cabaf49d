"""Algorithms: the base class, the registry, and the built-in algorithms (one module each).

Importing this package registers the built-ins: grpo, max_rl, echo, opd, opsd, sft (sft_distill.py).
"""

from primejax.orchestrator.algorithms import echo, grpo, max_rl, opd, opsd, sft_distill  # noqa: F401  (registration)
from primejax.orchestrator.algorithms.advantage import (
    AdvantageInputs,
    AdvantageOutputs,
    register_advantage,
    registered_advantages,
)
from primejax.orchestrator.algorithms.base import (
    LOSS_TYPES,
    Algorithm,
    AlgorithmConfig,
    ImportConfig,
    ModelRefConfig,
    SamplingSourceConfig,
    algorithm_class,
    build_algorithm,
    register_algorithm,
    registered_algorithms,
)
from primejax.orchestrator.algorithms.echo import EchoConfig
from primejax.orchestrator.algorithms.grpo import AdvantageConfig, GRPOConfig, LengthPenaltyConfig
from primejax.orchestrator.algorithms.opd import OPDConfig
from primejax.orchestrator.algorithms.opsd import OPSDConfig

__all__ = [
    "LOSS_TYPES",
    "Algorithm",
    "AlgorithmConfig",
    "ImportConfig",
    "ModelRefConfig",
    "SamplingSourceConfig",
    "GRPOConfig",
    "AdvantageConfig",
    "LengthPenaltyConfig",
    "EchoConfig",
    "OPDConfig",
    "OPSDConfig",
    "AdvantageInputs",
    "AdvantageOutputs",
    "register_advantage",
    "registered_advantages",
    "algorithm_class",
    "build_algorithm",
    "register_algorithm",
    "registered_algorithms",
]
