"""The rules that span sections: the one place where a key's validity depends on another section's.

A rule inside one section lives in that section's `check()` (e.g. `orchestrator.batch_size` divisible by
`group_size`); only what needs two sections is here. Each raises `ConfigError` naming the key to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from primejax.utils.devices import check_layout
from primejax.utils.sections import ConfigError

if TYPE_CHECKING:
    from primejax.config import Config


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
    try:  # a GPU node's layout: the trainer and a launched server see disjoint GPUs, or both see all
        check_layout(c.trainer.devices, c.inference.devices, c.inference.enabled)
    except ValueError as e:
        key, _, msg = str(e).partition(": ")
        raise ConfigError(key, msg) from None
    if o.routing_replay:
        _check_routing_replay(c)
    if (
        c.trainer.loss.type != "default"
    ):  # an objective of its own replaces the rl component the corrections change
        for name in o.envs:
            if not o.env_algo(name).correction.is_default:
                own = o.envs[name].algo.type
                key = f"orchestrator.envs.{name}.algo.correction" if own else "orchestrator.algo.correction"
                raise ConfigError(
                    key,
                    f"applies to the default rl loss; trainer.loss.type = {c.trainer.loss.type!r} "
                    "replaces it",
                )


def _check_routing_replay(c: Config) -> None:
    """Routing replay needs an MoE policy and a server that returns routed experts (docs/moe.md)."""
    if c.inference.enabled and not c.inference.return_routed_experts:
        raise ConfigError("inference.return_routed_experts", "must be True with orchestrator.routing_replay")
    from pathlib import Path

    from primejax.inference.routed_experts import RoutingShape
    from primejax.models.config import MOE_MODEL_TYPES

    tiny = c.model.build_tiny
    if tiny.enabled and not (Path(c.model.path) / "config.json").exists():  # the launcher builds it first
        if tiny.family not in MOE_MODEL_TYPES:
            raise ConfigError(
                "orchestrator.routing_replay",
                f"needs an MoE model; model.build_tiny.family is {tiny.family!r}",
            )
        return
    try:
        routing = RoutingShape.of_model_dir(c.model.path)
    except (OSError, ValueError) as e:
        raise ConfigError(
            "model.path", f"orchestrator.routing_replay needs the model's config.json ({e})"
        ) from None
    if routing is None:
        raise ConfigError("orchestrator.routing_replay", f"needs an MoE model; {c.model.path} is dense")
