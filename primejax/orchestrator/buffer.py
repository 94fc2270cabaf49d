"""The prompt source: which (environment, example index) pairs each step samples, and what it learns from
each finished group (docs/architecture.md#difficulty-pools-and-online-difficulty-filtering).

Environments are drawn in proportion to their `weight`, examples uniformly among the env's indices still in
rotation. After each group, its mean reward is compared with `easy_threshold` / `hard_threshold`: at or
above the first the example retires to the `easy` pool, at or below the second to the `hard` pool (a
threshold of None turns its pool off). Pools are saved with each orchestrator checkpoint as
`easy_examples.jsonl` / `hard_examples.jsonl`; on resume, `easy_fraction` / `hard_fraction` of each pool are
lifted back into rotation at random. Online difficulty filtering drops groups whose mean reward is exactly 0
(all failed) or 1 (all solved) on the way into the batch: their group-relative credit is zero anyway.

The state is a seeded `random.Random` plus the pools, so it checkpoints as JSON.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from primejax.envs.base import Environment
from primejax.envs.env_limits import EnvLimits
from primejax.orchestrator.config import BufferConfig

POOLS = ("easy", "hard")
UNBOUNDED = 2**31 - 1


@dataclass
class EnvSlot:
    name: str
    env: Environment
    weight: float
    algorithm: Any  # primejax.orchestrator.algorithms.Algorithm
    limits: EnvLimits | None = None  # orchestrator.envs.<name>.limits (None: none)


BufferSettings = BufferConfig  # the `orchestrator.buffer` section is the buffer's settings


class Buffer:
    def __init__(self, envs: list[EnvSlot], seed: int, settings: BufferSettings | None = None):
        if not envs:
            raise ValueError("the buffer needs at least one environment")
        self.envs = {slot.name: slot for slot in envs}
        self.settings = settings or BufferSettings()
        self.rng = random.Random(seed)
        self.pools: dict[str, dict[str, set[int]]] = {kind: {n: set() for n in self.envs} for kind in POOLS}
        self._observed: Counter = Counter()  # groups per env since the last step_metrics()
        self._evicted: Counter = Counter()  # (env, pool) -> examples retired since the last step_metrics()
        self._filtered: Counter = Counter()  # (env, easy|hard) -> rollouts ODF dropped since then

    def _bound(self, name: str) -> int:
        n = self.envs[name].env.num_examples
        return UNBOUNDED if n is None else n

    def retired(self, name: str) -> set[int]:
        return self.pools["easy"][name] | self.pools["hard"][name]

    def _index(self, name: str) -> int:
        bound = self._bound(name)
        easy, hard = self.pools["easy"][name], self.pools["hard"][name]
        if len(easy) + len(hard) >= bound:
            raise RuntimeError(
                f"environment {name!r} has no example left in rotation (all in difficulty pools)"
            )
        while True:  # rejection sampling; switch to an explicit list once most examples are retired
            if len(easy) + len(hard) > bound // 2:
                return self.rng.choice(sorted(set(range(bound)) - easy - hard))
            index = self.rng.randrange(bound)
            if index not in easy and index not in hard:
                return index

    def sample(self, num_groups: int, skip: set[str] = frozenset()) -> list[tuple[str, int]]:
        """`num_groups` (env name, example index) pairs for the next step; none of an env in `skip` (the
        continuous pool's envs at their limits.max_concurrent; at least one env must be left)."""
        names = [n for n in self.envs if n not in skip]
        if not names:
            raise ValueError("every environment was skipped")
        weights = [self.envs[n].weight for n in names]
        picks = self.rng.choices(names, weights=weights, k=num_groups)
        return [(name, self._index(name)) for name in picks]

    def observe_group(self, env: str, index: int, rewards: list[float]) -> bool:
        """Learn from a finished group (its clean rollouts' rewards); False = drop the group (ODF)."""
        if not rewards:
            return True  # every rollout errored: nothing to learn, and nothing trainable to drop
        s = self.settings
        mean = sum(rewards) / len(rewards)
        self._observed[env] += 1
        if s.easy_threshold is not None and mean >= s.easy_threshold:
            self._retire(env, index, "easy")
        elif s.hard_threshold is not None and mean <= s.hard_threshold:
            self._retire(env, index, "hard")
        if s.online_difficulty_filtering and mean in (0.0, 1.0):
            self._filtered[(env, "hard" if mean == 0.0 else "easy")] += len(rewards)
            return False
        return True

    def _retire(self, env: str, index: int, pool: str) -> None:
        if index not in self.pools[pool][env]:
            self.pools[pool][env].add(index)
            self._evicted[(env, pool)] += 1

    def lift(self) -> dict[str, int]:
        """Move `easy_fraction` / `hard_fraction` of each env's pool back into rotation (at random)."""
        lifted = {}
        for pool, fraction in (("easy", self.settings.easy_fraction), ("hard", self.settings.hard_fraction)):
            for env, indices in self.pools[pool].items():
                k = round(fraction * len(indices))
                chosen = self.rng.sample(sorted(indices), k) if k else []
                indices.difference_update(chosen)
                lifted[f"{env}/{pool}"] = k
        return lifted

    def step_metrics(self) -> dict[str, float]:
        """`pool/{env}/{easy,normal,hard}` (share of the env's examples; unbounded envs: retired counts),
        `evicted_examples/{env}/{easy,hard}` (share of this step's groups retired), `filtered_rollouts/
        {env}/{easy,hard}` (rollouts ODF dropped). Resets the per-step counters."""
        out: dict[str, float] = {}
        for env in self.envs:
            bound = self.envs[env].env.num_examples
            easy, hard = len(self.pools["easy"][env]), len(self.pools["hard"][env])
            if bound:
                out.update(
                    {
                        f"pool/{env}/easy": easy / bound,
                        f"pool/{env}/hard": hard / bound,
                        f"pool/{env}/normal": (bound - easy - hard) / bound,
                    }
                )
            else:
                out.update({f"pool/{env}/easy_count": float(easy), f"pool/{env}/hard_count": float(hard)})
            groups = self._observed[env]
            for pool in POOLS:
                out[f"evicted_examples/{env}/{pool}"] = self._evicted[(env, pool)] / groups if groups else 0.0
                if self.settings.online_difficulty_filtering:
                    out[f"filtered_rollouts/{env}/{pool}"] = float(self._filtered[(env, pool)])
        self._observed.clear()
        self._evicted.clear()
        self._filtered.clear()
        return out

    # ------------------------------------------------------------------------------------ persistence

    def pool_records(self, pool: str) -> list[dict[str, Any]]:
        """One JSON record per pooled example (the lines of `<pool>_examples.jsonl`)."""
        records = []
        for env, indices in self.pools[pool].items():
            slot = self.envs[env]
            for index in sorted(indices):
                records.append({"env": env, "index": index, "key": slot.env.example(index).key})
        return records

    def state_dict(self, include_pools: bool = True) -> dict[str, Any]:
        """RNG state and (unless the pools travel separately, as checkpoint JSONL files) the pools: a full
        snapshot, so restoring it also rewinds a step that has to be generated again."""
        version, internal, gauss = self.rng.getstate()
        state: dict[str, Any] = {"rng": [version, list(internal), gauss]}
        if include_pools:
            state["pools"] = {
                pool: {env: sorted(ix) for env, ix in envs.items()} for pool, envs in self.pools.items()
            }
        return state

    def load_state_dict(
        self, state: dict[str, Any], records: dict[str, list[dict[str, Any]]] | None = None
    ) -> None:
        """Restore a `state_dict()`; pools come from `state["pools"]` or from checkpoint `records`
        (`{"easy": [...], "hard": [...]}`, as written by `pool_records`). Lifting is a separate `lift()`."""
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        if "pools" in state:
            records = {
                pool: [{"env": env, "index": i} for env, ix in envs.items() for i in ix]
                for pool, envs in state["pools"].items()
            }
        if records is None:
            return
        for pool in POOLS:
            for env in self.envs:
                self.pools[pool][env] = set()
            for rec in records.get(pool, []):
                if rec["env"] in self.envs:  # an env dropped from the config since: its pool goes too
                    self.pools[pool][rec["env"]].add(int(rec["index"]))
