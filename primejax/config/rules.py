"""The rules that span sections: the one place where a key's validity depends on another section's.

A rule inside one section lives in that section's `check()` (e.g. `orchestrator.batch_size` divisible by
`group_size`); only what needs two sections is here. Each raises `ConfigError` naming the key to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from primejax.utils.sections import ConfigError

if TYPE_CHECKING:
    from primejax.config import Config

# The loss component each built-in algorithm's sampled tokens feed (docs/algorithms.md).
ALGORITHM_LOSS = {"grpo": "rl", "max_rl": "rl", "echo": "rl", "opd": "ref_kl", "opsd": "ref_kl", "sft": "ce"}
GRPO_FAMILY = ("grpo", "max_rl", "echo")


def check(c: Config) -> None:
    o = c.orchestrator
    prompt_and_completion = o.max_prompt_tokens + o.sampling.max_tokens
    if c.inference.enabled and c.inference.max_model_len < prompt_and_completion:
        raise ConfigError(
            "inference.max_model_len",
            f"must be >= orchestrator.max_prompt_tokens + sampling.max_tokens "
            f"({o.max_prompt_tokens} + {o.sampling.max_tokens})",
        )
    s = c.trainer.scheduler
    if s.type != "constant" and s.warmup_steps >= s.total_steps(c.run.max_steps):
        raise ConfigError("trainer.scheduler.warmup_steps", "must be smaller than the decay steps")
    if c.sft.steps > 0 and not (c.sft.data_path or c.sft.from_env):
        raise ConfigError("sft.data_path", "SFT needs a data file (sft.data_path) or an env (sft.from_env)")
    if c.sft.from_env and c.sft.from_env not in o.envs:
        raise ConfigError("sft.from_env", f"{c.sft.from_env!r} is not an orchestrator.envs entry")
    if not c.model.path and not c.trainer.fake_data.enabled:
        raise ConfigError("model.path", "must name an HF model directory")
    check_algorithms(c)


def check_algorithms(c: Config) -> None:
    """Component compatibility of every env's resolved algorithm (docs/algorithms.md)."""
    o = c.orchestrator
    algo = o.algo
    types = {"orchestrator.algo.type": algo.type}
    types.update({f"orchestrator.envs.{n}.algo": e.algo for n, e in o.envs.items() if e.algo})
    frozen = algo.sampling.source == "frozen"
    for key, name in types.items():
        loss = ALGORITHM_LOSS.get(name)
        if loss is None:
            continue  # a user-registered algorithm: checked when it is built
        if frozen and loss != "ce":
            raise ConfigError(
                key,
                f"{name!r} trains with {loss}: frozen-model sampling can only feed the ce loss "
                "(rl and ref_kl need the live policy's sampling logprobs)",
            )
        if name == "sft" and not frozen:
            raise ConfigError(
                "orchestrator.algo.sampling.source",
                "sft needs a frozen source (CE on the policy's own tokens is no distillation target)",
            )
        if name == "opd":
            if algo.teacher.name == "policy":
                raise ConfigError(
                    "orchestrator.algo.teacher", "opd against the live policy is degenerate (zero KL)"
                )
            if not algo.teacher.base_url:
                raise ConfigError("orchestrator.algo.teacher.base_url", "opd needs a frozen teacher endpoint")
        if algo.length_penalty.type != "none" and name not in GRPO_FAMILY:
            raise ConfigError(
                "orchestrator.algo.length_penalty.type",
                f"length penalties apply to the grpo family ({', '.join(GRPO_FAMILY)}), not {name!r}",
            )
