"""opd: on-policy distillation. The policy samples; each sample is scored by a frozen teacher and trained with
the per-token reverse KL toward it (`ref_kl` loss component, evaluated in the trainer against the live policy).

Reference scoring (docs/algorithms.md): on arrival, every sample's own context (prompt + sampled
tokens, one prefill per interleaved sample) is sent to the teacher's /v1/completions with `prompt_logprobs`;
the logprobs at the sampled positions become `rollout.ref_logprobs`. No credit: advantages stay None, so
advantage-based filters never fire and no advantage stream ships. The teacher must share the policy's
tokenizer (scoring is token-level) and be a vLLM server (the only one exposing prompt_logprobs).
"""

from __future__ import annotations

from primejax.orchestrator.algorithms.advantage import reference_logprobs
from primejax.orchestrator.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    ModelRefConfig,
    register_algorithm,
)
from primejax.orchestrator.rollout import Rollout
from primejax.utils.sections import ConfigError, section, sub


@section
class OPDConfig(AlgorithmConfig):
    """On-policy distillation toward a frozen teacher."""

    teacher: ModelRefConfig = sub(ModelRefConfig, "the frozen teacher (same tokenizer; a vLLM server)")

    def check(self) -> None:
        super().check()
        if self.teacher.name == "policy":
            raise ConfigError("teacher", "opd against the live policy is degenerate (zero KL)")
        if not self.teacher.base_url:
            raise ConfigError("teacher.base_url", "opd needs a frozen teacher endpoint")


@register_algorithm("opd")
class OPDAlgorithm(Algorithm):
    action_loss_type = "ref_kl"
    config_class = OPDConfig
    config: OPDConfig

    def setup(self) -> None:
        super().setup()
        self.teacher_client = self.connect(self.config.teacher)

    async def score_rollout(self, rollout: Rollout) -> None:
        rollout.ref_logprobs = await reference_logprobs(rollout, self.teacher_client.score)
