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
        1024.0, "offload: MiB per device of fp32 master weights per update bucket (3x that of state on device)", gt=0
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

    type: str = option("default", "default: DPPO + KL; custom: import_path", choices=("default", "custom"))
    dppo_mask_low: float = option(0.2, "DPPO trust region below the sampling probability", ge=0)
    dppo_mask_high: float = option(0.2, "DPPO trust region above the sampling probability", ge=0)
    adv_tau: float = option(1.0, "advantage scale", ge=0)
    kl_tau: float = option(1e-3, "KL penalty scale", ge=0)
    is_clip: float = option(8.0, "importance-ratio clip", gt=0)
    import_path: str = option("", "custom: 'module.function' computing one sequence's loss")
    kwargs: dict = option(doc="custom: keyword arguments of that function", factory=dict)
    # MoE models only (models/moe.py); off by default, as in prime-rl's RL runs.
    moe_aux_coef: float = option(0.0, "MoE: weight of the load-balancing loss (mean over sparse layers)", ge=0)
    moe_z_coef: float = option(0.0, "MoE: weight of the router z-loss (mean over sparse layers)", ge=0)

    def check(self) -> None:
        if self.type == "custom" and "." not in self.import_path:
            raise ConfigError("import_path", "custom loss needs an import path 'module.function'")


@section
class ISWeightConfig(Section):
    """Importance weight sg(pi_theta / mu) on the rl policy-gradient term (docs/algorithms.md#corrections)."""

    level: str = option(
        "none",
        "none | token (TIS) | sequence (product of token ratios) | geometric (their geometric mean)",
        choices=("none", "token", "sequence", "geometric"),
    )
    cap: float = option(2.0, "truncation: weights above this become this (TIS)", gt=0)
    normalize: bool = option(
        False,
        "divide by the weights' mean over the whole step's tokens (or sequences) that reject and icepop accept; "
        "one extra forward pass",
    )


@section
class RejectConfig(Section):
    """Rejection (the mask of masked importance sampling): drop tokens or whole sequences whose divergence
    leaves [low, high]. A mask only; the IS weight of MIS is `is_weight` (docs/algorithms.md#corrections)."""

    level: str = option(
        "none",
        "none | token | sequence (the sum of the divergence over the sequence: k1 gives the log of the product "
        "of its ratios) | geometric (its mean: k1 gives the log of their geometric mean)",
        choices=("none", "token", "sequence", "geometric"),
    )
    divergence: str = option("k1", "k1 = log(pi/mu); k3 = pi/mu - 1 - log(pi/mu) (>= 0)", choices=("k1", "k3"))
    low: float = option(-0.693, "lowest accepted divergence (k1: log 0.5)")
    high: float = option(0.693, "highest accepted divergence (k1: log 2)")

    def check(self) -> None:
        if not self.low < self.high:
            raise ConfigError("low", f"must be below high ({self.high}), got {self.low}")


@section
class IcepopConfig(Section):
    """IcePop: drop tokens whose ratio pi/mu leaves [low, high]. On the plain dppo objective a kept token
    weighs its ratio unclipped (IcePop's M(k) = k): `high` bounds it, trainer.loss.is_clip does not apply."""

    enabled: bool = option(False, "mask tokens whose ratio leaves [low, high]")
    low: float = option(0.5, "lowest accepted ratio", ge=0)
    high: float = option(5.0, "highest accepted ratio", gt=0)

    def check(self) -> None:
        if not self.low < self.high:
            raise ConfigError("low", f"must be below high ({self.high}), got {self.low}")


@section
class GspoConfig(Section):
    """GSPO's sequence-ratio clip range [1 - eps_low, 1 + eps_high] and how sequences are weighed."""

    eps_low: float = option(3e-4, "the range's lower side: 1 - eps_low", ge=0)
    eps_high: float = option(4e-4, "the range's upper side: 1 + eps_high", ge=0)
    norm: str = option(
        "sequence",
        "sequence: each sequence's loss is the mean over its tokens and every sequence weighs the same (the "
        "paper); token: summed over tokens like dppo (a sequence weighs its length)",
        choices=("sequence", "token"),
    )


CISPO_MASKS = ("none", "ratio", "dppo")


@section
class CispoConfig(Section):
    """CISPO's IS-weight clip range and its optional mask (MiniMax-M1, arXiv:2506.13585, section 3.1)."""

    # The paper keeps no lower bound (a large eps_low: 1 clips at 0) and tunes only eps_high, without giving
    # its value; 1 (a weight of at most 2) is the TIS cap default.
    eps_low: float = option(1.0, "the weight's lower bound: 1 - eps_low (floored at 0)", ge=0)
    eps_high: float = option(1.0, "the weight's upper bound: 1 + eps_high", ge=0)
    mask: str = option(
        "none",
        "none: no mask, every token trains (the paper's CISPO); ratio: the paper's unified mask M_t, PPO's "
        "trust region on the ratio (A > 0 and r > 1 + mask_eps_high, or A < 0 and r < 1 - mask_eps_low, get no "
        "gradient); dppo: DPPO's probability-difference masks (trainer.loss.dppo_mask_low/high)",
        choices=CISPO_MASKS,
    )
    mask_eps_low: float = option(0.2, "mask = ratio: the trust region's lower side 1 - mask_eps_low", ge=0)
    mask_eps_high: float = option(0.2, "mask = ratio: the trust region's upper side 1 + mask_eps_high", ge=0)


OBJECTIVES = ("dppo", "gspo", "gspo_token", "cispo")


@section
class CorrectionConfig(Section):
    """Off-policy / mismatch corrections of the rl loss for the tokens of one algorithm block (one env).

    The trainer's rl loss per token is -keep * adv_tau * pg + kl_tau * log(pi/mu)^2; `objective` picks pg,
    the masks multiply keep (docs/algorithms.md#corrections has every formula, its source and when to use it).
    """

    objective: str = option(
        "dppo",
        "dppo: A*min(pi/mu, is_clip) with DPPO's masks; gspo / gspo_token: sequence ratio, clipped; "
        "cispo: sg(clipped pi/mu)*A*log pi",
        choices=OBJECTIVES,
    )
    is_weight: ISWeightConfig = sub(ISWeightConfig, "importance weight (dppo objective only)")
    reject: RejectConfig = sub(RejectConfig, "rejection: the mask of masked importance sampling (MIS)")
    icepop: IcepopConfig = sub(IcepopConfig, "IcePop's two-sided token ratio mask")
    gspo: GspoConfig = sub(GspoConfig, "gspo / gspo_token: the sequence ratio's clip range, normalization")
    cispo: CispoConfig = sub(CispoConfig, "cispo: the IS weight's clip range, optional mask")

    def check(self) -> None:
        if self.objective != "dppo" and self.is_weight.level != "none":
            raise ConfigError("is_weight.level", f"must be 'none' with objective {self.objective!r}: its ratio "
                                                 "already is the importance weight")
        if self.is_weight.normalize and self.is_weight.level == "none":
            raise ConfigError("is_weight.normalize", "needs is_weight.level (token, sequence or geometric)")
        if self.objective == "gspo" and (self.icepop.enabled or self.reject.level == "token"):
            key = "icepop.enabled" if self.icepop.enabled else "reject.level"
            raise ConfigError(key, "a token mask inside gspo's sequence ratio still trains the masked tokens "
                                   "through it: use objective 'gspo_token' or a sequence-level reject.level")

    @property
    def is_default(self) -> bool:
        return self == CorrectionConfig()


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
    "CorrectionConfig",
    "ISWeightConfig",
    "RejectConfig",
    "IcepopConfig",
    "GspoConfig",
    "CispoConfig",
    "OBJECTIVES",
    "CheckpointConfig",
    "FakeDataConfig",
    "BroadcastConfig",
    "DistributedConfig",
    "TrainerConfig",
]
