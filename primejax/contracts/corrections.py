"""Off-policy corrections of the rl loss, per algorithm block (so per environment): the config both sides read.

The orchestrator's algorithm blocks carry one `CorrectionConfig` each (`orchestrator.algo.correction`,
`orchestrator.envs.<name>.algo.correction`); the trainer builds its per-environment table of them
(primejax/trainer/corrections.py) and applies it in the rl loss. Every formula, its source and when to use it:
docs/algorithms.md#corrections.
"""

from __future__ import annotations

from primejax.utils.sections import ConfigError, Section, option, section, sub


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
    divergence: str = option(
        "k1", "k1 = log(pi/mu); k3 = pi/mu - 1 - log(pi/mu) (>= 0)", choices=("k1", "k3")
    )
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
            raise ConfigError(
                "is_weight.level",
                f"must be 'none' with objective {self.objective!r}: its ratio "
                "already is the importance weight",
            )
        if self.is_weight.normalize and self.is_weight.level == "none":
            raise ConfigError("is_weight.normalize", "needs is_weight.level (token, sequence or geometric)")
        if self.objective == "gspo" and (self.icepop.enabled or self.reject.level == "token"):
            key = "icepop.enabled" if self.icepop.enabled else "reject.level"
            raise ConfigError(
                key,
                "a token mask inside gspo's sequence ratio still trains the masked tokens "
                "through it: use objective 'gspo_token' or a sequence-level reject.level",
            )

    @property
    def is_default(self) -> bool:
        return self == CorrectionConfig()
