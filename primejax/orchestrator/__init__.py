"""The orchestrator: prompts -> rollouts (env <-> inference) -> credit -> filters -> samples -> batches.

Importing the package imports nothing else: its config section (`primejax.orchestrator.config`) is read by
processes that never run an orchestrator.
"""

from typing import Any

_EXPORTS = {
    "Orchestrator": "primejax.orchestrator.loop",
    "StepResult": "primejax.orchestrator.loop",
    "PolicyTracker": "primejax.orchestrator.policy",
    "min_policy_version": "primejax.orchestrator.policy",
    "staleness": "primejax.orchestrator.policy",
    "Rollout": "primejax.orchestrator.rollout",
    "TrajectoryStep": "primejax.orchestrator.rollout",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'primejax.orchestrator' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = list(_EXPORTS)
