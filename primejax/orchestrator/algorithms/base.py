"""The Algorithm abstraction (docs/algorithms.md).

The pipeline calls exactly two non-virtual methods: `finalize_rollout(rollout)` on arrival and
`finalize_group(group)` once the group is complete. They drive the two override points:

* `async score_rollout(rollout)`: one rollout, on arrival, no siblings — rollout-local credit or model I/O
  (reference scoring for opd/opsd, observation ce weights for echo).
* `score_group(group)`: the whole group, synchronous, before the filters — group-relative credit.

`action_loss_type` says which loss component the sampled tokens feed (rl / ce / ref_kl); the sample builder
turns it into weight streams. Errored rollouts never reach the hooks: they carry no reward to learn from.

Each algorithm declares its options as a config section (`config_class`, a subclass of `AlgorithmConfig`) and
its config-time rules (`check_config`); `orchestrator.algo` (and each `orchestrator.envs.<name>.algo`) is one
block whose `type` selects the class, so the central config lists no algorithm's options or rules.

Model references: the live policy's client is handed in (`policy_client`);
every other model is a frozen OpenAI-compatible endpoint the algorithm connects itself in `setup()` with
`connect(ref)`. With `algo.sampling.source = "frozen"` rollouts are sampled from that endpoint
(`sampling_client`, which the generator prefers over the policy's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from primejax.contracts.batch import LOSS_COMPONENTS
from primejax.contracts.corrections import CorrectionConfig
from primejax.orchestrator.rollout import Rollout
from primejax.orchestrator.sampling import SamplingConfig
from primejax.utils.sections import ConfigError, Section, option, section, sub

LOSS_TYPES = LOSS_COMPONENTS  # a sample trains one loss component (contracts/batch.py)


@section
class ModelRefConfig(Section):
    """A model that is not the live policy: an external OpenAI-compatible (vLLM) endpoint."""

    name: str = option("", "served model name ('' = the server's only model)")
    base_url: tuple = option((), "endpoint URLs, e.g. ('http://127.0.0.1:8001/v1',)")


@section
class ImportConfig(Section):
    """A user function named by import path, with its keyword arguments."""

    import_path: str = option("", "'module.function' (or 'module:function'); '' = none")
    kwargs: dict = option(doc="keyword arguments passed to it", factory=dict)

    def check(self) -> None:
        if self.import_path and "." not in self.import_path and ":" not in self.import_path:
            raise ConfigError(
                "import_path", f"must be an import path 'module.function', got {self.import_path!r}"
            )


@section
class SamplingSourceConfig(Section):
    """Where rollouts are sampled: the live policy, or a frozen model (only the ce loss can learn from it)."""

    source: str = option("policy", "the live policy, or a frozen model", choices=("policy", "frozen"))
    frozen: ModelRefConfig = sub(ModelRefConfig, "the frozen sampler (source = frozen)")

    def check(self) -> None:
        if self.source == "frozen" and not self.frozen.base_url:
            raise ConfigError("frozen.base_url", "frozen sampling needs an endpoint")


@section
class AlgorithmConfig(Section):
    """An algorithm block: `type` picks the registered algorithm, whose config class adds its own keys."""

    name: ClassVar[str] = "any algorithm"
    type: str = option("grpo", "the registered algorithm (grpo, max_rl, echo, opd, opsd, sft, or your own)")
    sampling: SamplingSourceConfig = sub(SamplingSourceConfig, "the sampling source")
    correction: CorrectionConfig = sub(
        CorrectionConfig, "off-policy corrections of the rl loss on this block's tokens (docs/algorithms.md)"
    )

    def check(self) -> None:
        if self.type in _ALGORITHMS:  # one registered later (by an env module) is checked when it is built
            _ALGORITHMS[self.type].check_config(self)

    @classmethod
    def variants(cls) -> list[type[Section]]:
        out: list[type[Section]] = [AlgorithmConfig]
        for algo in _ALGORITHMS.values():
            if algo.config_class not in out:
                out.append(algo.config_class)
        return out

    @classmethod
    def variant(cls, node: Mapping[str, Any]) -> type[Section]:
        name = node.get("type", "grpo")
        if not name:
            return AlgorithmConfig  # an env's block left empty: it inherits orchestrator.algo
        if (
            name not in _ALGORITHMS
        ):  # not registered yet: only the common keys, checked again when it is built
            return AlgorithmConfig
        return _ALGORITHMS[name].config_class


class Algorithm:
    """Subclass, override the hook(s) your signal needs, and `@register_algorithm("name")` the class.

    Options of your own: a `config_class` (subclass of `AlgorithmConfig`, a `@section`) read as `self.config`.
    """

    action_loss_type: ClassVar[str] = "rl"
    config_class: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig

    @classmethod
    def check_config(cls, config: AlgorithmConfig) -> None:
        """Config-time rules of this algorithm (raise ConfigError naming the key, relative to the block)."""
        if config.sampling.source == "frozen" and cls.action_loss_type != "ce":
            raise ConfigError(
                "type",
                f"{config.type!r} trains with {cls.action_loss_type}: frozen-model sampling "
                "can only feed the ce loss (rl and ref_kl need the live policy's sampling "
                "logprobs)",
            )
        if cls.action_loss_type != "rl" and not config.correction.is_default:
            raise ConfigError(
                "correction",
                f"corrects the rl loss, and {config.type!r} trains with "
                f"{cls.action_loss_type}: leave it at its defaults",
            )

    def __init__(
        self,
        config: AlgorithmConfig,
        *,
        policy_client: Any = None,
        tokenizer: Any = None,
        sampling: SamplingConfig | None = None,
    ):
        self.config = config  # this env's algorithm block (an instance of `config_class`)
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
                raise ValueError(
                    f"{type(self).__name__}: advantages do not cover the rollout's sampled tokens"
                )
            r.finalized = True


_ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(name: str) -> Callable[[type[Algorithm]], type[Algorithm]]:
    def decorate(cls: type[Algorithm]) -> type[Algorithm]:
        if cls.action_loss_type not in LOSS_TYPES:
            raise ValueError(f"{cls.__name__}.action_loss_type must be one of {LOSS_TYPES}")
        if not issubclass(cls.config_class, AlgorithmConfig):
            raise TypeError(f"{cls.__name__}.config_class must subclass AlgorithmConfig")
        _ALGORITHMS[name] = cls
        names = [n for n, a in _ALGORITHMS.items() if a.config_class is cls.config_class]
        if cls.config_class is not AlgorithmConfig:
            cls.config_class.name = ", ".join(names)  # how --help=keys and errors name the key's owners
        return cls

    return decorate


def algorithm_class(name: str) -> type[Algorithm]:
    if name not in _ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r} (registered: {sorted(_ALGORITHMS)})")
    return _ALGORITHMS[name]


def registered_config_class(name: str) -> type[AlgorithmConfig] | None:
    return _ALGORITHMS[name].config_class if name in _ALGORITHMS else None


def registered_algorithms() -> list[str]:
    return sorted(_ALGORITHMS)


def build_algorithm(name: str, config: AlgorithmConfig, **resources: Any) -> Algorithm:
    cls = algorithm_class(name)
    if not isinstance(config, cls.config_class):
        raise ConfigError(
            "algo",
            f"{name!r} reads {cls.config_class.__name__} but got {type(config).__name__}: "
            "import the module that registers it before the config is read",
        )
    cls.check_config(config)
    algorithm = cls(config, **resources)
    algorithm.setup()
    return algorithm
