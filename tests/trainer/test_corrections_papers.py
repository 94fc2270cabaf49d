"""Each correction of the menu against a float64 NumPy reference written from its paper, value and gradient.

`test_corrections.py` transcribes docs/algorithms.md; here each reference is the paper's own objective,
written per sequence with explicit loops, in the form it takes with one optimizer step per batch: the PPO
ratio against pi_old is pi_theta / sg(pi_theta) (value 1, gradient grad log pi), stop-gradient parts are
evaluated at a frozen copy `lp0`, and the gradient is a finite difference in `lp` with `lp0` fixed.
The rl loss's KL term (kl_tau) is the project's own addition: 0 here. DPPO's trust-region masks belong to the
dppo objective, not to the corrections layered on it (TIS, MIS, IcePop): they are widened out of reach
(dppo_mask_* = 1) where a dppo-based correction is checked against its paper.

The batch (test_corrections.make_batch, weights 0 or 1): packed rows with padding and prompt tokens, a
zero-advantage sequence, a sequence without rl tokens and one far off-policy sequence. Every case also
asserts that its masks and clips fire on it (some tokens, not all), so that none passes vacuously.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primejax.contracts.corrections import (
    CispoConfig,
    CorrectionConfig,
    GspoConfig,
    IcepopConfig,
    ISWeightConfig,
    RejectConfig,
)
from primejax.trainer.config import LossConfig
from primejax.trainer.corrections import CorrectionTable, step_norms
from primejax.trainer.losses import global_counts, make_loss_fn, member_masks
from tests.trainer.test_corrections import make_batch

TOL = 1e-10
# no KL term, no advantage scale; DPPO's probability-difference masks out of reach (|pi - mu| < 1 always)
PAPER = LossConfig(kl_tau=0.0, adv_tau=1.0, is_clip=1.1, dppo_mask_low=1.0, dppo_mask_high=1.0)
# cispo is checked with DPPO's masks narrow enough to fire on its batch: they must not apply to it
DPPO = LossConfig(kl_tau=0.0, adv_tau=1.0, is_clip=1.1, dppo_mask_low=0.05, dppo_mask_high=0.05)


def paper_batch(seed: int, token_advantages: bool = False):
    lp, b = make_batch(seed)
    b = dict(b, rl_weights=(b["rl_weights"] != 0).astype(np.float64))  # papers weigh every token 1
    if token_advantages:  # GSPO-token's per-token advantages: vary within each sequence, keep the zero one
        rng = np.random.default_rng(seed + 100)
        b["advantages"] = b["advantages"] * rng.uniform(0.2, 1.8, b["advantages"].shape)
    return lp, b


def sequences(b):
    """(row, positions of its rl tokens) per packed sequence that has rl tokens."""
    member = b["loss_mask"] & (b["rl_weights"] != 0)
    out = []
    for row in range(b["segment_ids"].shape[0]):
        for s in np.unique(b["segment_ids"][row]):
            idx = np.nonzero((b["segment_ids"][row] == s) & member[row])[0]
            if s > 0 and len(idx):
                out.append((row, idx))
    return out


class Fired:
    """Counts, per named condition, the tokens where it held and where it could have (to assert 0 < n < all)."""

    def __init__(self):
        self.n: dict[str, list[int]] = {}

    def add(self, name: str, cond) -> None:
        c = np.asarray(cond, bool)
        hit, total = self.n.get(name, [0, 0])
        self.n[name] = [hit + int(c.sum()), total + c.size]


# --------------------------------------------------------------------------------- the papers' objectives
# Each returns the loss (minus the objective) at lp, with sg parts at lp0; `fired` records masks and clips.


def tis(lp, lp0, b, c, fired):
    """Yao et al. 2025 (TIS): sum_t min(pi_old/mu, C) * A_t * pi/pi_old, token mean."""
    n = sum(len(i) for _, i in sequences(b))
    total = 0.0
    for row, i in sequences(b):
        w0 = np.exp(lp0[row, i] - b["inference_logprobs"][row, i])
        fired.add("truncated", w0 > c.is_weight.cap)
        total += np.sum(
            np.minimum(w0, c.is_weight.cap) * b["advantages"][row, i] * np.exp(lp[row, i] - lp0[row, i])
        )
    return -total / n


def seq_mis(lp, lp0, b, c, fired):
    """Liu, Li et al. 2025, Seq-MIS: a sequence is kept iff its ratio rho(y) = prod_t pi/mu is in
    [e^low, e^high] and then weighs rho(y): sum over kept sequences of rho(y) * sum_t A_t * pi/pi_old."""
    n = sum(len(i) for _, i in sequences(b))
    total = 0.0
    for row, i in sequences(b):
        log_rho = np.sum(lp0[row, i] - b["inference_logprobs"][row, i])  # log space: no overflow
        keep = c.reject.low <= log_rho <= c.reject.high
        fired.add("rejected", [not keep])
        if keep:
            total += np.exp(log_rho) * np.sum(b["advantages"][row, i] * np.exp(lp[row, i] - lp0[row, i]))
    return -total / n


def rejection(lp, lp0, b, c, fired):
    """Rejection sampling on the dppo objective (verl rollout_rs, token / sequence / geometric): tokens or
    sequences whose divergence leaves [low, high] are dropped, the rest keep A * min(pi/mu, is_clip)."""
    n = sum(len(i) for _, i in sequences(b))
    total = 0.0
    for row, i in sequences(b):
        lr0 = lp0[row, i] - b["inference_logprobs"][row, i]
        d = lr0 if c.reject.divergence == "k1" else np.exp(lr0) - 1 - lr0
        d = {"token": d, "sequence": np.full(len(i), d.sum()), "geometric": np.full(len(i), d.mean())}[
            c.reject.level
        ]
        keep = (d >= c.reject.low) & (d <= c.reject.high)
        fired.add("rejected", ~keep)
        r = np.exp(lp[row, i] - b["inference_logprobs"][row, i])
        total += np.sum(keep * b["advantages"][row, i] * np.minimum(r, PAPER.is_clip))
    return -total / n


def icepop(lp, lp0, b, c, fired):
    """IcePop (Ling team 2025): M(k) = k if low <= k <= high else 0, k = pi/mu at the sampled token, times
    A * pi/pi_old; token mean (the rl loss's normalization). trainer.loss.is_clip plays no part."""
    n = sum(len(i) for _, i in sequences(b))
    total = 0.0
    for row, i in sequences(b):
        k = np.exp(lp0[row, i] - b["inference_logprobs"][row, i])
        inside = (k >= c.icepop.low) & (k <= c.icepop.high)
        fired.add("masked", ~inside)
        fired.add("kept above is_clip", inside & (k > PAPER.is_clip))
        total += np.sum(np.where(inside, k, 0.0) * b["advantages"][row, i] * np.exp(lp[row, i] - lp0[row, i]))
    return -total / n


def gspo(lp, lp0, b, c, fired):
    """Zheng et al. 2025 (GSPO): 1/G sum_i min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i), s_i = (pi(y)/mu(y))^(1/|y|)
    with gradient through every token; G = the step's sequences."""
    seqs = sequences(b)
    total = 0.0
    for row, i in seqs:
        s = np.exp(np.mean(lp[row, i] - b["inference_logprobs"][row, i]))
        a = b["advantages"][row, i][0]
        lo, hi = 1 - c.gspo.eps_low, 1 + c.gspo.eps_high
        fired.add("clipped", [(a > 0 and s > hi) or (a < 0 and s < lo)])
        total += min(s * a, np.clip(s, lo, hi) * a)
    return -total / len(seqs)


def gspo_token(lp, lp0, b, c, fired):
    """GSPO-token (same paper): 1/G sum_i 1/|y_i| sum_t min(s_it A_it, clip(s_it) A_it),
    s_it = sg(s_i) * pi(y_t)/sg(pi(y_t))."""
    seqs = sequences(b)
    total = 0.0
    for row, i in seqs:
        s0 = np.exp(np.mean(lp0[row, i] - b["inference_logprobs"][row, i]))
        st = s0 * np.exp(lp[row, i] - lp0[row, i])
        a = b["advantages"][row, i]
        lo, hi = 1 - c.gspo.eps_low, 1 + c.gspo.eps_high
        fired.add("clipped", ((a > 0) & (s0 > hi)) | ((a < 0) & (s0 < lo)))
        total += np.mean(np.minimum(st * a, np.clip(st, lo, hi) * a))
    return -total / len(seqs)


def cispo(lp, lp0, b, c, fired):
    """MiniMax-M1 (arXiv:2506.13585) section 3.1, CISPO: 1/sum_i |o_i| sum_i sum_t sg(r^_it) A_it log pi,
    r^ = clip(pi/mu, 1 - eps_low, 1 + eps_high); with mask 'ratio' its unified form's M_it (0 where A > 0 and
    r > 1 + eps_high^M, or A < 0 and r < 1 - eps_low^M)."""
    n = sum(len(i) for _, i in sequences(b))
    total = 0.0
    for row, i in sequences(b):
        r0 = np.exp(lp0[row, i] - b["inference_logprobs"][row, i])
        a = b["advantages"][row, i]
        lo, hi = max(0.0, 1 - c.cispo.eps_low), 1 + c.cispo.eps_high
        fired.add("clipped below", r0 < lo)
        fired.add("clipped above", r0 > hi)
        d = np.exp(lp0[row, i]) - np.exp(b["inference_logprobs"][row, i])  # DPPO's masks are not CISPO's
        outside = ((a > 0) & (d > DPPO.dppo_mask_high)) | ((a <= 0) & (d < -DPPO.dppo_mask_low))
        fired.add("outside DPPO's trust region", outside)
        m = np.ones(len(i), bool)
        if c.cispo.mask == "ratio":
            m = ~(((a > 0) & (r0 > 1 + c.cispo.mask_eps_high)) | ((a < 0) & (r0 < 1 - c.cispo.mask_eps_low)))
            fired.add("masked", ~m)
        total += np.sum(m * np.clip(r0, lo, hi) * a * lp[row, i])
    return -total / n


# --------------------------------------------------------------------------------- cases


CASES = {
    "tis": (tis, CorrectionConfig(is_weight=ISWeightConfig(level="token", cap=1.5)), {}),
    "seq_mis": (
        seq_mis,
        CorrectionConfig(
            is_weight=ISWeightConfig(level="sequence", cap=2.0),
            reject=RejectConfig(level="sequence", divergence="k1", low=-0.693, high=0.693),
        ),
        {},
    ),
    "rs_token_k1": (rejection, CorrectionConfig(reject=RejectConfig(level="token", low=-0.3, high=0.3)), {}),
    "rs_sequence_k1": (
        rejection,
        CorrectionConfig(reject=RejectConfig(level="sequence", low=-0.693, high=0.693)),
        {},
    ),
    "rs_sequence_k3": (
        rejection,
        CorrectionConfig(reject=RejectConfig(level="sequence", divergence="k3", low=0.0, high=0.5)),
        {},
    ),
    "rs_geometric_k3": (
        rejection,
        CorrectionConfig(reject=RejectConfig(level="geometric", divergence="k3", low=0.0, high=0.05)),
        {},
    ),
    "icepop": (icepop, CorrectionConfig(icepop=IcepopConfig(enabled=True, low=0.5, high=2.0)), {}),
    "gspo": (gspo, CorrectionConfig(objective="gspo", gspo=GspoConfig(eps_low=0.05, eps_high=0.07)), {}),
    "gspo_token": (
        gspo_token,
        CorrectionConfig(objective="gspo_token", gspo=GspoConfig(eps_low=0.05, eps_high=0.07)),
        {"token_advantages": True},
    ),
    "cispo": (cispo, CorrectionConfig(objective="cispo", cispo=CispoConfig(eps_low=0.2, eps_high=0.2)), {}),
    "cispo_ratio_mask": (
        cispo,
        CorrectionConfig(
            objective="cispo", cispo=CispoConfig(eps_low=0.3, eps_high=0.5, mask="ratio", mask_eps_high=0.1)
        ),
        {},
    ),
}


def project_loss(lp, b, c, cfg: LossConfig = PAPER):
    table = CorrectionTable((c,), (0, 0), ("e0", "e1"))
    jb = {k: jnp.asarray(v) for k, v in b.items()}
    counts = global_counts(jb)
    counts.update(step_norms(jnp.asarray(lp), jb, member_masks(jb)["rl"], table))
    x = jnp.asarray(lp)
    loss, sums = make_loss_fn(cfg, 0, table)(x, jnp.zeros_like(x), jb, counts)
    return sums["loss/rl"]


def fd_grad(f, lp0, b, h=2e-4):
    """d f / d lp at lp0 (sg parts frozen at lp0), 4-point central differences, over the rl tokens."""
    g = np.zeros_like(lp0)
    for row, i in sequences(b):
        for j in i:

            def at(delta, row=row, j=j):
                x = lp0.copy()
                x[row, j] += delta
                return f(x)

            g[row, j] = (8 * (at(h) - at(-h)) - (at(2 * h) - at(-2 * h))) / (12 * h)
    return g


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_correction_matches_its_paper_fp64(name, seed):
    ref_fn, c, batch_kw = CASES[name]
    cfg = DPPO if c.objective == "cispo" else PAPER
    lp, b = paper_batch(seed, **batch_kw)
    fired = Fired()
    ref = ref_fn(lp, lp, b, c, fired)
    with jax.enable_x64(True):
        loss = float(project_loss(lp, b, c, cfg))
        grad = np.asarray(jax.grad(lambda x: project_loss(x, b, c, cfg))(jnp.asarray(lp)))
    assert abs(loss - ref) <= TOL * max(1.0, abs(ref)), (loss, ref)
    np.testing.assert_allclose(grad, fd_grad(lambda x: ref_fn(x, lp, b, c, Fired()), lp, b), rtol=0, atol=TOL)
    assert fired.n, "the reference records its masks and clips"
    for cond, (hit, total) in fired.n.items():
        assert 0 < hit < total, f"{name}: '{cond}' held on {hit} of {total}: the case does not exercise it"


def test_icepop_logs_its_m_function_as_the_weight():
    """The logged IS weight of IcePop's tokens is M(k): k inside [low, high], 0 outside (a rejected token's
    ratio, possibly astronomically large, is not a weight anything applies)."""
    from primejax.trainer.losses import finalize_metrics

    _, c, _ = CASES["icepop"]
    lp, b = paper_batch(0)
    table = CorrectionTable((c,), (0, 0), ("e0", "e1"))
    jb = {k: jnp.asarray(v) for k, v in b.items()}
    counts = global_counts(jb)
    x = jnp.asarray(lp)
    _, sums = make_loss_fn(PAPER, 0, table)(x, jnp.zeros_like(x), jb, counts)
    m = finalize_metrics(sums, counts, table)
    k = np.concatenate([np.exp(lp[row, i] - b["inference_logprobs"][row, i]) for row, i in sequences(b)])
    big = np.concatenate([b["env_ids"][row, i] for row, i in sequences(b)]) == 0
    mk = np.where((k >= c.icepop.low) & (k <= c.icepop.high), k, 0.0)
    assert k[big].max() > c.icepop.high  # some env-0 token is rejected for a ratio above the range
    assert float(m["corrections/env/e0/is_weight_max"]) == pytest.approx(mk[big].max(), rel=1e-6)
    assert float(m["corrections/env/e0/is_weight_mean"]) == pytest.approx(mk[big].mean(), rel=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_extreme_ratios_stay_finite_and_are_rejected(name):
    """A sequence whose every token has log(pi/mu) = +-80 (its ratio product e^(80 |y|) overflows any float):
    loss and gradient stay finite in float32, and a rejecting correction drops the whole sequence."""
    _, c, batch_kw = CASES[name]
    lp, b = paper_batch(0, **batch_kw)
    lq = b["inference_logprobs"].copy()
    far = b["segment_ids"][0] == 2
    lq[0, far] = lp[0, far] - 80.0  # mu ~ e^-80 times pi: a sampler bug, not a mismatch
    lq[1, 5:9] = lp[1, 5:9] + 80.0
    b = dict(b, inference_logprobs=lq)
    table = CorrectionTable((c,), (0, 0), ("e0", "e1"))
    jb = {k: jnp.asarray(v, jnp.float32 if v.dtype == np.float64 else None) for k, v in b.items()}

    def loss_of(x):
        counts = global_counts(jb)
        counts.update(step_norms(x, jb, member_masks(jb)["rl"], table))
        loss, sums = make_loss_fn(PAPER, 0, table)(x, jnp.zeros_like(x), jb, counts)
        return loss, sums

    x = jnp.asarray(lp, jnp.float32)
    (loss, sums), grad = jax.value_and_grad(loss_of, has_aux=True)(x)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
    assert all(np.isfinite(np.asarray(v)).all() for v in sums.values())
    if c.reject.level != "none" or c.icepop.enabled:
        member = b["loss_mask"] & (b["rl_weights"] != 0)
        rejected = float(sums["corr/env/e0/rejected"] + sums["corr/env/e1/rejected"])
        assert rejected >= member[0, far].sum()
