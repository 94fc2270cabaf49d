"""max_rl: MaxRL (arXiv:2602.02710), GRPO's centered reward normalized by the group *mean*.

(s_i - mean) / mean is an unbiased gradient of the order-`group_size` truncation of the maximum-likelihood
objective and upweights hard prompts like 1/p; a group whose mean is <= 0 (nothing solved) gets zero credit.
Length penalty and custom advantage come from the grpo family.
"""

from __future__ import annotations

from primejax.orchestrator.algorithms.base import register_algorithm
from primejax.orchestrator.algorithms.grpo import GRPOAlgorithm


@register_algorithm("max_rl")
class MaxRLAlgorithm(GRPOAlgorithm):
    default_advantage = "mean_normalized"  # advantage.py
