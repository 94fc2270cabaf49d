"""`orchestrator.sampling`: the sampling parameters of every rollout request.

Its own module so that what reads it (the generator, every algorithm) imports it downward, not the whole config.
"""

from __future__ import annotations

from primejax.utils.sections import MAX_TOKENS, Section, option, section


@section
class SamplingConfig(Section):
    """Sampling parameters of every rollout request."""

    temperature: float = option(
        1.0,
        "sampling temperature, > 0 (the trainer divides the logits by it; 0 = greedy has no logprobs to train "
        "on)",
        gt=0,
    )
    top_p: float = option(1.0, "nucleus sampling mass, in (0, 1]", gt=0, le=1)
    max_tokens: int = option(128, "completion tokens per turn", gt=0, le=MAX_TOKENS)
    max_turns: int = option(4, "model turns per rollout (multi-turn envs)", gt=0)
    seed: int = option(-1, "per-request seed base; -1 = unseeded (needs async_level 0)")
