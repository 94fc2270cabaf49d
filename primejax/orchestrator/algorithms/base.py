"""The Algorithm abstraction (docs/algorithms.md).

The pipeline calls exactly two non-virtual methods: `finalize_rollout(rollout)` on arrival and
`finalize_group(group)` once the group is complete. They drive the two override points:

* `async score_rollout(rollout)`: one rollout, on arrival, no siblings — rollout-local credit or model I/O
  (reference scoring for opd/opsd, observation ce weights for echo).
* `score_group(group)`: the whole group, synchronous, before the filters — group-relative credit.

`action_loss_type` says which loss component the sampled tokens feed (rl / ce / ref_kl); the sample builder
turns it into weight streams. Errored rollouts never reach the hooks: they carry no reward to learn from.

Model references: the live policy's client is handed in (`policy_client`);
every other model is a frozen OpenAI-compatible endpoint the algorithm connects itself in `setup()` with
`connect(ref)`. With `algo.sampling.source = "frozen"` rollouts are sampled from that endpoint
(`sampling_client`, which the generator prefers over the policy's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from primejax.orchestrator.config import AlgoConfig, EnvConfig, ModelRefConfig, SamplingConfig
from primejax.orchestrator.rollout import Rollout

LOSS_TYPES = ("rl", "ce", "ref_kl")


class Algorithm:
    """Subclass, override the hook(s) your signal needs, and `@register_algorithm("name")` the class."""

    action_loss_type: ClassVar[str] = "rl"

    def __init__(self, config: AlgoConfig, *, policy_client: Any = None, tokenizer: Any = None,
                 sampling: SamplingConfig | None = None):
        self.config = config  # the resolved orchestrator.algo section
        self.policy_client = policy_client  # the live policy's inference client (host-owned resource)
        self.tokenizer = tokenizer
        self.sampling = sampling  # orchestrator.sampling (max_tokens, temperature, ...)
        self.sampling_client: Any = None  # None = sample from the live policy
        self._connected: list[Any] = []

    def setup(self) -> None:
        """Build what the algorithm needs from its own config (reference clients, renderers).
        Subclasses call super().setup() first."""
        source = self.config.sampling
        if source.source == "frozen":
            self.sampling_client = self.connect(source.frozen)

    def connect(self, ref: ModelRefConfig) -> Any:
        """A client for a frozen model reference (`name` + `base_url`); closed by `close()`."""
        # deferred: httpx is only needed with references
        from primejax.inference.client import InferenceClient

        urls = [u.rstrip("/").removesuffix("/v1") for u in ref.base_url]
        if not urls:
            raise ValueError(f"{type(self).__name__}: a frozen model reference needs a base_url")
        client = InferenceClient(urls, model=ref.name or None)
        self._connected.append(client)
        return client

    async def close(self) -> None:
        for client in self._connected:
            await client.close()
        self._connected.clear()

    async def score_rollout(self, rollout: Rollout) -> None:
        """Rollout-local credit or reference I/O, on arrival."""

    def score_group(self, group: list[Rollout]) -> None:
        """Group-relative credit over the group's clean rollouts (errored ones are not passed)."""

    async def finalize_rollout(self, rollout: Rollout) -> None:
        if rollout.ok:
            await self.score_rollout(rollout)

    def finalize_group(self, group: list[Rollout]) -> None:
        clean = [r for r in group if r.ok]
        if clean:
            self.score_group(clean)
        for r in group:
            if r.ok and r.advantages is not None and len(r.advantages) != r.num_completion_tokens:
                raise ValueError(f"{type(self).__name__}: advantages do not cover the rollout's sampled tokens")
            r.finalized = True


_ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(name: str) -> Callable[[type[Algorithm]], type[Algorithm]]:
    def decorate(cls: type[Algorithm]) -> type[Algorithm]:
        if cls.action_loss_type not in LOSS_TYPES:
            raise ValueError(f"{cls.__name__}.action_loss_type must be one of {LOSS_TYPES}")
        _ALGORITHMS[name] = cls
        return cls

    return decorate


def algorithm_class(name: str) -> type[Algorithm]:
    if name not in _ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r} (registered: {sorted(_ALGORITHMS)})")
    return _ALGORITHMS[name]


def registered_algorithms() -> list[str]:
    return sorted(_ALGORITHMS)


def build_algorithm(name: str, config: AlgoConfig, **resources: Any) -> Algorithm:
    algorithm = algorithm_class(name)(config, **resources)
    algorithm.setup()
    return algorithm


def env_algo_config(algo: AlgoConfig, env_entry: EnvConfig) -> AlgoConfig:
    """The `orchestrator.algo` section as one env resolves it: its own custom advantage, when it names one,
    replaces the global one."""
    if not env_entry.advantage.import_path:
        return algo
    return algo.replace(advantage=env_entry.advantage)
