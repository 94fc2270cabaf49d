"""opsd: SDFT (arXiv:2601.19897), on-policy self-distillation toward the policy conditioned on a demonstration.

The reference is the live policy itself, scored under a demonstration-conditioned context: a leading system
message `algo.template.format(demonstration=...)` rendered with the policy's tokenizer (the hint block), then
the sample's tokens verbatim (`hint + token_ids`, the hint's logprobs sliced back off), so the join is
token-exact whatever the prompt and however many turns. The demonstration is the example's
`info[algo.demo_key]`, falling back to the example field of that name (e.g. `answer`). Loss: `ref_kl` on the
sampled tokens; no credit.
"""

from __future__ import annotations

from typing import Any

from primejax.orchestrator.algorithms.advantage import reference_logprobs
from primejax.orchestrator.algorithms.base import Algorithm, AlgorithmConfig, register_algorithm
from primejax.orchestrator.rollout import Rollout
from primejax.utils.sections import option, section


@section
class OPSDConfig(AlgorithmConfig):
    """Self-distillation toward the live policy conditioned on a demonstration."""

    demo_key: str = option("demonstration", "the example's info key (or field) holding the demonstration")
    template: str = option("Here is an expert demonstration:\n{demonstration}", "the hint's system message")


def demonstration(rollout: Rollout, key: str) -> Any:
    example = rollout.example
    if key in example.info:
        return example.info[key]
    value = getattr(example, key, None)
    if value is None:
        raise KeyError(f"opsd: example {example.key!r} has no demonstration (info[{key!r}] or .{key})")
    return value


@register_algorithm("opsd")
class OPSDAlgorithm(Algorithm):
    action_loss_type = "ref_kl"
    config_class = OPSDConfig
    config: OPSDConfig

    def setup(self) -> None:
        super().setup()
        if self.policy_client is None or self.tokenizer is None:
            raise ValueError("opsd scores with the live policy: it needs the policy client and tokenizer")

    def hint_ids(self, demo: Any) -> list[int]:
        text = (
            demo
            if isinstance(demo, str)
            else "\n".join(map(str, demo))
            if isinstance(demo, list)
            else str(demo)
        )
        system = [{"role": "system", "content": self.config.template.format(demonstration=text)}]
        rendered = self.tokenizer.apply_chat_template(system, tokenize=False, add_generation_prompt=False)
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    async def score_rollout(self, rollout: Rollout) -> None:
        hint = self.hint_ids(demonstration(rollout, self.config.demo_key))
        rollout.ref_logprobs = await reference_logprobs(rollout, self.policy_client.score, hint)
