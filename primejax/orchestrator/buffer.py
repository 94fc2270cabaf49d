"""The prompt source: which (environment, example index) pairs each step samples.

Environments are drawn in proportion to their `weight`, examples uniformly among the env's indices that
are in rotation. The whole state is a seeded `random.Random` plus, per env, the indices retired from
rotation (empty until difficulty pools arrive), so it checkpoints as JSON. `observe_group` is the seam where
the difficulty pools and online difficulty filtering (issue 7) learn from each finished group.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from primejax.envs.base import Environment


@dataclass
class EnvSlot:
    name: str
    env: Environment
    weight: float
    algorithm: Any  # primejax.orchestrator.algorithms.Algorithm


class Buffer:
    def __init__(self, envs: list[EnvSlot], seed: int):
        if not envs:
            raise ValueError("the buffer needs at least one environment")
        self.envs = {slot.name: slot for slot in envs}
        self.rng = random.Random(seed)
        self.retired: dict[str, set[int]] = {slot.name: set() for slot in envs}

    def _index(self, name: str) -> int:
        env = self.envs[name].env
        bound = env.num_examples if env.num_examples is not None else 2**31 - 1
        retired = self.retired[name]
        if len(retired) >= bound:
            raise RuntimeError(f"environment {name!r} has no example left in rotation")
        while True:  # rejection: the retired set is small next to the index space
            index = self.rng.randrange(bound)
            if index not in retired:
                return index

    def sample(self, num_groups: int) -> list[tuple[str, int]]:
        """`num_groups` (env name, example index) pairs for the next step."""
        names = list(self.envs)
        weights = [self.envs[n].weight for n in names]
        picks = self.rng.choices(names, weights=weights, k=num_groups)
        return [(name, self._index(name)) for name in picks]

    def observe_group(self, env: str, index: int, rewards: list[float]) -> bool:
        """Learn from a finished group; return False to drop the group before it reaches the batch."""
        return True

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss],
                "retired": {name: sorted(ix) for name, ix in self.retired.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        for name, indices in state.get("retired", {}).items():
            if name in self.retired:
                self.retired[name] = set(indices)
