"""The `trainer` config section and its sub-sections (optimizer, schedule, loss, checkpoints, mesh, ...).

Light on purpose (no JAX import): the launcher and `--help=keys` read it without starting a backend.
"""

from __future__ import annotations

from primejax.models.sharding import MeshConfig  # built from the mesh-axis table: a new axis is one file
from primejax.transports.weights.config import BroadcastConfig  # the transport owns its section
from primejax.utils.sections import MAX_ROWS, MAX_TOKENS, ConfigError, Section, option, section, sub


@section
class OptimConfig(Section):
    """AdamW behind global-norm gradient clipping."""

    type: str = option("adamw", "optimizer", choices=("adamw",))
    lr: float = option(1e-6, "peak learning rate", ge=0)
    b1: float = option(0.9, "Adam beta1")
    b2: float = option(0.999, "Adam beta2")
    eps: float = option(1e-8, "Adam epsilon")
    weight_decay: float = option(0.01, "decoupled weight decay (matrices only)", ge=0)
    max_norm: float = option(1.0, "global gradient-norm clip; 0 = off", ge=0)
    offload: bool = option(
        False,
        "keep the fp32 master weights and AdamW moments in pinned host memory, streamed bucket by bucket through "
        "the update; the devices keep model.param_dtype compute copies (set bfloat16 to save memory), docs/memory.md",
    )
    offload_bucket_mb: float = option(
        1024.0,
        "offload: MiB per device of fp32 master weights per update bucket (3x that of state on device)",
        gt=0,
    )
    offload_master: bool = option(
        True,
        "offload: the fp32 master weights in host memory too; False keeps them on the devices (4 B/param there) "
        "and only the AdamW moments cross PCIe (8 of 12 B/param each way per step)",
    )
    offload_inflight: int = option(
        1,
        "offload: buckets in flight at once; 2 lets a bucket's copy to the devices run beside the previous "
        "bucket's update and copy back (one more bucket of state on the devices)",
        ge=1,
        le=4,
    )
    offload_resident_gib: float = option(
        0.0,
        "offload: GiB per device of the state that would rest in host memory kept on the devices instead (whole "
        "buckets, master and moments, from the first): spend what the offload freed there and skip their copies",
        ge=0,
    )


@section
class SchedulerConfig(Section):
    """Learning-rate schedule: linear warm-up, then constant or a decay to lr * min_lr_ratio."""

    type: str = option("constant", "schedule shape", choices=("constant", "linear", "cosine"))
    warmup_steps: int = option(0, "linear warm-up steps", ge=0)
    decay_steps: int = option(0, "step the decay ends at; 0 = run.max_steps", ge=0)
    min_lr_ratio: float = option(0.0, "final lr as a fraction of lr", ge=0, le=1)

    def total_steps(self, max_steps: int) -> int:
        return self.decay_steps or max_steps


@section
class LossConfig(Section):
    """The rl loss (DPPO + KL, or a custom per-sequence function); ce and ref_kl tokens have fixed losses."""

    type: str = option(
        "default",
        "default: DPPO + KL (with the per-env corrections); a registered rl objective's name (ppo_clip, or "
        "your own: trainer/objectives.py); custom: the function at import_path",
    )
    dppo_mask_low: float = option(0.2, "DPPO trust region below the sampling probability", ge=0)
    dppo_mask_high: float = option(0.2, "DPPO trust region above the sampling probability", ge=0)
    adv_tau: float = option(1.0, "advantage scale", ge=0)
    kl_tau: float = option(1e-3, "KL penalty scale", ge=0)
    is_clip: float = option(8.0, "importance-ratio clip", gt=0)
    import_path: str = option("", "custom: 'module.function' computing one sequence's loss")
    kwargs: dict = option(
        doc="a registered or custom objective: keyword arguments of its function", factory=dict
    )
    # MoE models only (models/moe.py); off by default, as in prime-rl's RL runs.
    moe_aux_coef: float = option(
        0.0, "MoE: weight of the load-balancing loss (mean over sparse layers)", ge=0
    )
    moe_z_coef: float = option(0.0, "MoE: weight of the router z-loss (mean over sparse layers)", ge=0)

    def check(self) -> None:
        if not self.type:
            raise ConfigError("type", "must be 'default', a registered rl objective's name, or 'custom'")
        if self.type == "custom" and "." not in self.import_path:
            raise ConfigError("import_path", "custom loss needs an import path 'module.function'")


@section
class CheckpointConfig(Section):
    """Trainer checkpoints (orbax) under checkpoints/step_N/trainer."""

    interval: int = option(10, "save every this many steps (and the last); 0 = never", ge=0)
    keep: int = option(2, "checkpoints kept (newest)", ge=0)
    async_save: bool = option(True, "write in the background while training continues")


@section
class FakeDataConfig(Section):
    """Benchmark mode: random full rows instead of rollouts."""

    enabled: bool = option(False, "train on random rows (no orchestrator)")
    seq_len: int = option(2048, "row length", gt=0, le=MAX_TOKENS)
    rows: int = option(8, "rows per step", gt=0, le=MAX_ROWS)
    export: bool = option(False, "also time the weight broadcast each step")


@section
class DistributedConfig(Section):
    """Multi-process (multi-host) JAX; each host may override with PRIMEJAX_* environment variables."""

    coordinator_address: str = option("", "host:port of process 0's coordinator")
    num_processes: int = option(1, "trainer processes", ge=1)
    process_id: int = option(0, "this process's index", ge=0)


@section
class TrainerConfig(Section):
    """The trainer process: waits for rollouts/step_N, trains, exports broadcasts/step_N."""

    mesh: MeshConfig = sub(MeshConfig, "device mesh")
    micro_batch_size: int = option(
        1, "packed rows per micro-batch (gradient accumulation over the rest)", gt=0, le=MAX_ROWS
    )
    logprob_chunk_size: int = option(
        1024, "tokens per chunk of the LM head (never full [T, V] fp32 logits)", gt=0, le=MAX_TOKENS
    )
    lm_head_saved_logits_gib: float = option(
        -1.0, "GiB per device of fp32 logits the LM head may keep for its backward; -1 = auto (0 on CPU)"
    )
    optim: OptimConfig = sub(OptimConfig, "optimizer")
    scheduler: SchedulerConfig = sub(SchedulerConfig, "learning-rate schedule")
    loss: LossConfig = sub(LossConfig, "the rl loss")
    checkpoint: CheckpointConfig = sub(CheckpointConfig, "trainer checkpoints")
    on_nonfinite: str = option("skip", "what a NaN/inf loss or gradient does", choices=("skip", "stop"))
    batch_timeout_s: float = option(3600.0, "how long to wait for rollouts/step_N before failing", ge=0)
    keep_rollouts: int = option(
        4,
        "consumed rollouts/step_N kept: the newest N plus those after the newest checkpoint; -1 = all",
        ge=-1,
    )
    fake_data: FakeDataConfig = sub(FakeDataConfig, "benchmark mode")
    broadcast: BroadcastConfig = sub(BroadcastConfig, "weight export")
    peak_flops: float = option(989e12, "per-device peak FLOP/s for MFU (H100/H200 SXM dense bf16)", gt=0)
    distributed: DistributedConfig = sub(DistributedConfig, "multi-process JAX")
    devices: str = option("", "accelerator ids, e.g. '0,1' (CUDA_VISIBLE_DEVICES); '' = all")
    memory_fraction: float = option(
        0.0, "share of each of its GPUs JAX may preallocate; 0 = JAX's default (75%)", ge=0, le=1
    )

    def check(self) -> None:
        if self.lm_head_saved_logits_gib < 0 and self.lm_head_saved_logits_gib != -1:
            raise ConfigError("lm_head_saved_logits_gib", "must be >= 0 (GiB) or -1 (auto)")


__all__ = [
    "MeshConfig",
    "OptimConfig",
    "SchedulerConfig",
    "LossConfig",
    "CheckpointConfig",
    "FakeDataConfig",
    "BroadcastConfig",
    "DistributedConfig",
    "TrainerConfig",
]
