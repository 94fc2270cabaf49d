"""The orchestrator: prompts -> rollouts (env <-> inference) -> credit -> filters -> samples -> batches."""

from primejax.orchestrator.loop import Orchestrator, StepResult
from primejax.orchestrator.policy import PolicyTracker, min_policy_version, staleness
from primejax.orchestrator.rollout import Rollout, TrajectoryStep

__all__ = ["Orchestrator", "StepResult", "PolicyTracker", "min_policy_version", "staleness", "Rollout",
           "TrajectoryStep"]
