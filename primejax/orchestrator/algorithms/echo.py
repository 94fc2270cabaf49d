"""echo: GRPO on the sampled tokens plus weighted cross-entropy on environment-provided observation tokens.

ECHO trains the policy to also predict what the environment said back (tool output, user feedback), each
role at its own weight: `algo.roles` maps role -> alpha (ECHO's lambda; default `{"tool": 0.1}`; setting
it replaces the whole table). Observation tokens are attributed structurally in `score_rollout`: the
messages the environment added before model call k (k >= 1) are located, by their content tokens, in call k's
prompt ids, searching back from its end (so only the newly arrived observation is weighted: earlier ones
were weighted in the step that introduced them, and the dataset prompt of the first call is never an
observation). Chat-template framing tokens (role headers, end markers) are not content and get no weight.

Optional user filter (`algo.filter.import_path` + `kwargs`): `fn(rollout, **kwargs)` returns one
keep-mask per model call spanning that call's `prompt_ids`; False means never echo-trained.
"""

from __future__ import annotations

from typing import Any

from primejax.orchestrator.algorithms.advantage import import_object
from primejax.orchestrator.algorithms.base import ImportConfig, register_algorithm
from primejax.orchestrator.algorithms.grpo import GRPOAlgorithm, GRPOConfig
from primejax.orchestrator.rollout import Rollout
from primejax.utils.sections import ConfigError, option, section, sub


@section
class EchoConfig(GRPOConfig):
    """ECHO: grpo plus weighted ce on environment-provided observation tokens."""

    roles: dict = option(
        doc="role -> ce weight alpha of its observation tokens (replaces the whole table)",
        factory=lambda: {"tool": 0.1},
    )
    filter: ImportConfig = sub(ImportConfig, "a user keep-mask over observation tokens")

    def check(self) -> None:
        super().check()
        for role, alpha in self.roles.items():
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0:
                raise ConfigError("roles", f"role {role!r}: alpha must be a number >= 0")


def find_last(haystack: list[int], needle: list[int], end: int) -> int:
    """Start of the last occurrence of `needle` inside haystack[:end], or -1."""
    n = len(needle)
    for start in range(end - n, -1, -1):
        if haystack[start : start + n] == needle:
            return start
    return -1


def observations_by_call(rollout: Rollout) -> list[list[dict[str, Any]]]:
    """For each model call, the environment messages that arrived just before it ([] for the first call)."""
    turns: list[list[dict[str, Any]]] = [[]]
    for message in rollout.messages[len(rollout.example.prompt) :]:
        if message.get("role") == "assistant":
            turns.append([])
        else:
            turns[-1].append(message)
    return turns[: len(rollout.steps)]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [])


@register_algorithm("echo")
class EchoAlgorithm(GRPOAlgorithm):
    config_class = EchoConfig
    config: EchoConfig

    def setup(self) -> None:
        super().setup()
        if self.tokenizer is None:
            raise ValueError("echo attributes observation tokens by role: it needs the policy tokenizer")
        self.roles = {str(k): float(v) for k, v in self.config.roles.items()}
        flt = self.config.filter
        self.user_filter = None
        if flt.import_path:
            fn, kwargs = import_object(flt.import_path), dict(flt.kwargs)
            self.user_filter = lambda rollout: fn(rollout, **kwargs)

    def observation_weights(self, rollout: Rollout) -> list[list[float] | None]:
        """Per model call, ce weights over its prompt ids (None where the call has no weighted observation)."""
        out: list[list[float] | None] = []
        for step, messages in zip(rollout.steps, observations_by_call(rollout), strict=True):
            weights = [0.0] * len(step.prompt_ids)
            end = len(step.prompt_ids)
            for message in reversed(messages):
                ids = list(self.tokenizer.encode(_text(message.get("content")), add_special_tokens=False))
                start = find_last(step.prompt_ids, ids, end) if ids else -1
                if start < 0:
                    continue  # not rendered verbatim (template rewrote it): leave it out rather than guess
                end = start
                alpha = self.roles.get(str(message.get("role")), 0.0)
                weights[start : start + len(ids)] = [alpha] * len(ids)
            out.append(weights if any(weights) else None)
        return out

    async def score_rollout(self, rollout: Rollout) -> None:
        weights = self.observation_weights(rollout)
        if self.user_filter is not None:
            masks = self.user_filter(rollout)
            if len(masks) != len(rollout.steps):
                raise ValueError(
                    f"echo filter returned {len(masks)} masks for {len(rollout.steps)} model calls"
                )
            for i, (w, keep, step) in enumerate(zip(weights, masks, rollout.steps, strict=True)):
                if len(keep) != len(step.prompt_ids):
                    raise ValueError(
                        f"echo filter mask {i} has {len(keep)} entries, the call's prompt "
                        f"{len(step.prompt_ids)}"
                    )
                if w is not None:
                    kept = [x if k else 0.0 for x, k in zip(w, keep, strict=True)]
                    weights[i] = kept if any(kept) else None
        for step, w in zip(rollout.steps, weights, strict=True):
            step.prompt_ce_weights = w
