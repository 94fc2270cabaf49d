"""Offline evaluation: pass@1, pass@k and reward metrics of one policy over the eval envs. The process (`python -m
primejax.eval`) is primejax/entrypoints/eval.py; its usage says what is sampled and how it is seeded."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primejax.config.cli import UsageError

if TYPE_CHECKING:
    from primejax.orchestrator.config import OrchestratorConfig

log = logging.getLogger("primejax.eval")


class _Version:
    """The evaluator's version source: the weights loaded for this evaluation."""

    def __init__(self, version: int):
        self.version = version


def weights_version(weights: str) -> int:
    """`.../step_N` -> N (so samples are tagged with the trainer step they evaluate), else 1."""
    from primejax.contracts.rundir import parse_step

    step = parse_step(weights)
    return 1 if step is None else step


def seeded(o: OrchestratorConfig, seed: int) -> OrchestratorConfig:
    """`o` with per-request sampling seeds: its own `sampling.seed`, else `seed` (module docstring). Seeds need
    async_level 0, which an offline evaluation (no trainer) is anyway."""
    from primejax.utils.sections import replace_key

    if o.sampling.seed >= 0:
        return o
    if not dataclasses.is_dataclass(o):  # an untyped ConfigDict (tests, library callers): a changed copy
        o = o.copy_and_resolve_references()
        o.async_level, o.sampling.seed = 0, seed
        return o
    return replace_key(replace_key(o, "async_level", 0), "sampling.seed", seed)


async def evaluate(
    o: OrchestratorConfig, model_path: str, client: Any, weights: str | None = None, seed: int = 0
) -> dict[str, float]:
    """Load `weights` (if any) into the server behind `client` and run the eval envs once, sampling seeded."""
    from primejax.orchestrator.evaluator import build_evaluator
    from primejax.rendering.renderer import build_renderer, load_tokenizer

    o = seeded(o, seed)
    version = 0
    if weights:
        path = Path(weights)
        if not any(path.glob("*.safetensors")):
            raise UsageError(f"--weights: {weights} holds no .safetensors (a broadcast or HF directory)")
        version = weights_version(weights)
        await client.update_weights(str(path.resolve()), version)
    tokenizer = load_tokenizer(model_path)
    renderer = build_renderer(o.renderer.name, tokenizer)
    metrics = await build_evaluator(o, client, renderer, _Version(version)).run(version)
    return {"eval/weights_version": float(version), **metrics}
