"""Off-policy and mismatch corrections of the rl loss (docs/algorithms.md#corrections).

Each algorithm block (so each environment) picks a `CorrectionConfig`; the batch says which environment every
token belongs to (`env_ids`) and how stale it is (`staleness`), and the trainer holds a static
`CorrectionTable`: the distinct corrections and which one each environment uses. Every correction is computed
over its own tokens only (its member mask), so a step mixing environments is the sum of their terms.

Per token, with lp = log pi_theta (trainer), lq = log mu (sampler), A = advantage, log_r = lp - lq,
r = exp(log_r), sg = stop-gradient, and a "sequence" = one packed segment's rl members:

    loss_t = -keep_t * adv_tau * pg_t + kl_tau * log_r^2        (the KL term is on every member, kept or not)

    objective dppo, no IS weight:  pg = A * min(r, is_clip)      (the default DPPO + KL loss)
        with icepop:               pg = A * r                    (IcePop's M(k) = k: the mask bounds r)
    objective dppo + is_weight:    pg = A * w~ * exp(lp - sg(lp))  (value A*w~, gradient A*w~*grad lp)
        token (TIS):   w = min(sg r, cap)
        sequence:      w = min(prod_seq sg r, cap)          (computed in log space)
        geometric:     w = min(exp(mean_seq sg log_r), cap)
        w~ = w / mean(w) over the whole step when `normalize` (over the tokens, or the sequences for the
        sequence levels, that MIS and icepop accept)
    gspo:        s = exp(mean_seq log_r) (gradient through every token of the sequence);
                 pg = min(s*A, clip(s, 1-eps_low, 1+eps_high)*A), divided by the sequence's |y| and scaled
                 by N_rl / N_seq for norm 'sequence' (the loss is then the mean over sequences, as in GSPO)
    gspo_token:  s_t = sg(s) * exp(lp - sg(lp));  pg = min(s_t*A, clip(s_t, ...)*A), normalized like gspo
    cispo:       pg = sg(clip(r, 1-eps_low, 1+eps_high)) * A * lp

    keep = member and accepted by: MIS (divergence k1 = log_r or k3 = r - 1 - log_r, of the token, the
    sequence's sum (k1: the log of the product of ratios) or its mean (geometric), inside [low, high]),
    icepop (r inside [low, high]), and the objective's trust region: DPPO's probability-difference masks for
    dppo, none for cispo unless `cispo.mask` (ratio: PPO's ratio mask; dppo: DPPO's), none for gspo.
    Masked tokens still count in N_rl, so the normalization (and therefore micro-batch independence) is
    unchanged.

Normalizing the IS weight needs the whole step's weights before the first micro-batch's gradient: the step
runs a forward-only pass over all micro-batches first (`norm_sums`, summed like the token counts), only when
some correction asks for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from primejax.contracts.batch import batch_env_names
from primejax.contracts.corrections import CorrectionConfig
from primejax.trainer.config import LossConfig

# exp() arguments are clipped here: a non-selected branch must stay finite (0 * inf is NaN in a gradient).
LOG_MAX = 60.0
# Sequence mean log-ratio histogram (the sequence's log of its geometric-mean ratio): bin upper edges.
HIST_EDGES = (-1.0, -0.3, -0.1, -0.03, -0.01, -0.003, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


@dataclasses.dataclass(frozen=True)
class CorrectionTable:
    """The static correction setup of a run: distinct corrections and the one each env index uses."""

    kinds: tuple[CorrectionConfig, ...] = (CorrectionConfig(),)
    env_kind: tuple[int, ...] = (0,)
    env_names: tuple[str, ...] = ("default",)
    staleness_bins: int = 3  # staleness 0, 1, ..., bins - 1 (the last bin holds everything older)

    @classmethod
    def from_orchestrator(cls, o: Any) -> CorrectionTable:
        """From the orchestrator config: envs in `env_names(o)` order, each with its algorithm block's
        correction; staleness binned up to async_level (older tokens land in the last bin)."""
        names = batch_env_names(o.envs)
        kinds: list[CorrectionConfig] = []
        env_kind = []
        for name in names:
            corr = o.env_algo(name).correction
            if corr not in kinds:
                kinds.append(corr)
            env_kind.append(kinds.index(corr))
        return cls(tuple(kinds), tuple(env_kind), names, staleness_bins=o.async_level + 2)

    @property
    def needs_norm(self) -> bool:
        return any(k.is_weight.normalize for k in self.kinds)

    @property
    def is_default(self) -> bool:
        return all(k.is_default for k in self.kinds)


def seq_sum(x: jax.Array, seg: jax.Array) -> jax.Array:
    """[B, T] -> [B, T]: at each token, the sum of x over its row's segment (segments are rows' own)."""
    b, t = x.shape
    gid = seg.astype(jnp.int32) + (t + 1) * jnp.arange(b, dtype=jnp.int32)[:, None]
    sums = jax.ops.segment_sum(x.reshape(-1), gid.reshape(-1), num_segments=b * (t + 1))
    return sums[gid]


def seq_first(mask: jax.Array, seg: jax.Array) -> jax.Array:
    """[B, T] bool: the first token of each segment where `mask` holds (one per segment that has one)."""
    b, t = mask.shape
    before = jnp.cumsum(mask, axis=1, dtype=jnp.int32) - mask  # mask tokens earlier in the row
    gid = seg.astype(jnp.int32) + (t + 1) * jnp.arange(b, dtype=jnp.int32)[:, None]
    start = jax.ops.segment_min(before.reshape(-1), gid.reshape(-1), num_segments=b * (t + 1))[gid]
    return mask & (before == start)


def _exp(x: jax.Array) -> jax.Array:
    return jnp.exp(jnp.clip(x, -LOG_MAX, LOG_MAX))


def _divergence(log_r: jax.Array, kind: str) -> jax.Array:
    if kind == "k1":
        return log_r
    x = jnp.clip(log_r, -LOG_MAX, LOG_MAX)
    return jnp.expm1(x) - x  # k3 = r - 1 - log r; expm1 keeps small |log r| exact


def _accept(log_r_sg, member, seg, c: CorrectionConfig) -> tuple[jax.Array, jax.Array]:
    """(accepted members, members rejected by MIS or icepop)."""
    ok = member
    if c.reject.level != "none":
        d = jnp.where(member, _divergence(log_r_sg, c.reject.divergence), 0.0)
        if (
            c.reject.level == "sequence"
        ):  # the sum: k1 is the log of the product of ratios (never exponentiated)
            d = seq_sum(d, seg)
        elif c.reject.level == "geometric":
            d = seq_sum(d, seg) / jnp.maximum(seq_sum(member.astype(d.dtype), seg), 1.0)
        ok = ok & (d >= c.reject.low) & (d <= c.reject.high)
    if c.icepop.enabled:
        r = _exp(log_r_sg)
        ok = ok & (r >= c.icepop.low) & (r <= c.icepop.high)
    return ok, member & ~ok


def raw_is_weight(log_r_sg, member, seg, c: CorrectionConfig) -> jax.Array:
    """The truncated IS weight of each member token (no normalization), stop-gradient inputs."""
    level, log_cap = c.is_weight.level, jnp.log(c.is_weight.cap)
    if level == "token":
        return jnp.minimum(_exp(log_r_sg), c.is_weight.cap)
    total = seq_sum(jnp.where(member, log_r_sg, 0.0), seg)
    if level == "sequence":
        return _exp(jnp.minimum(total, log_cap))
    n = jnp.maximum(seq_sum(member.astype(log_r_sg.dtype), seg), 1.0)
    return _exp(jnp.minimum(total / n, log_cap))  # geometric


def norm_sums(lp, lq, member, seg, c: CorrectionConfig) -> tuple[jax.Array, jax.Array]:
    """(sum of weights, how many) whose ratio is the step's mean IS weight: over accepted tokens (token level)
    or over sequences with an accepted token (sequence levels: each sequence counts once)."""
    log_r = jax.lax.stop_gradient(jnp.where(member, lp - lq, 0.0))
    acc, _ = _accept(log_r, member, seg, c)
    w = raw_is_weight(log_r, member, seg, c)
    if c.is_weight.level != "token":  # one vote per sequence: its first accepted token
        acc = seq_first(acc, seg)
    return jnp.sum(jnp.where(acc, w, 0.0)), jnp.sum(acc, dtype=w.dtype)


def _trust_region_masks(lp, lq, log_r_sg, adv, accepted, c: CorrectionConfig, cfg: LossConfig):
    """(masked_low, masked_high) of the objective's trust region: DPPO's probability-difference masks for dppo
    (and cispo with mask 'dppo'), PPO's ratio masks for cispo with mask 'ratio', none otherwise."""
    pos = adv > 0
    if c.objective == "dppo" or (c.objective == "cispo" and c.cispo.mask == "dppo"):
        d = jnp.exp(lp) - jnp.exp(lq)
        return accepted & ~pos & (d < -cfg.dppo_mask_low), accepted & pos & (d > cfg.dppo_mask_high)
    if c.objective == "cispo" and c.cispo.mask == "ratio":
        r = _exp(log_r_sg)
        return accepted & ~pos & (r < 1.0 - c.cispo.mask_eps_low), accepted & pos & (
            r > 1.0 + c.cispo.mask_eps_high
        )
    none = jnp.zeros_like(accepted)
    return none, none


def token_loss(
    lp,
    lq,
    adv,
    member,
    seg,
    c: CorrectionConfig,
    cfg: LossConfig,
    norm: jax.Array | None = None,
    seq_scale: jax.Array | None = None,
):
    """Per-token rl loss (unweighted) of correction `c` on its `member` tokens, and per-token indicators.

    `norm`: the step's mean IS weight when `c.is_weight.normalize` (see `norm_sums`). `seq_scale`: N_rl / N_seq
    of the whole step, for gspo's per-sequence normalization (a sequence's token shares sum to its loss times
    this, so that dividing by N_rl gives the mean over sequences)."""
    log_r = jnp.where(member, lp - lq, 0.0)  # where: padding lq = 0 must not produce exp overflow
    log_r_sg = jax.lax.stop_gradient(log_r)
    accepted, rejected = _accept(log_r_sg, member, seg, c)
    fm = member.astype(lp.dtype)
    n_seq = jnp.maximum(seq_sum(fm, seg), 1.0)
    mean_log_r = seq_sum(log_r, seg) / n_seq  # with gradient (gspo)
    masked_low, masked_high = _trust_region_masks(lp, lq, log_r_sg, adv, accepted, c, cfg)
    keep = accepted & ~(masked_low | masked_high)
    grad_lp = jnp.exp(lp - jax.lax.stop_gradient(lp))  # value 1, gradient grad lp
    if c.objective == "dppo" and c.is_weight.level == "none" and c.icepop.enabled:
        # IcePop's M(k) = k on kept tokens, 0 outside [low, high]: the mask bounds the ratio, not is_clip
        weight = jnp.where(accepted, _exp(log_r_sg), 0.0)
        pg = adv * _exp(log_r)
    elif c.objective == "dppo" and c.is_weight.level == "none":
        weight = jnp.minimum(_exp(log_r_sg), cfg.is_clip)
        pg = adv * jnp.minimum(jnp.exp(log_r), cfg.is_clip)
    elif c.objective == "dppo":
        weight = raw_is_weight(log_r_sg, member, seg, c)
        if c.is_weight.normalize:
            weight = weight / norm
        pg = adv * weight * grad_lp
    elif c.objective == "cispo":
        weight = jnp.clip(_exp(log_r_sg), max(0.0, 1.0 - c.cispo.eps_low), 1.0 + c.cispo.eps_high)
        pg = weight * adv * lp
    else:
        lo, hi = 1.0 - c.gspo.eps_low, 1.0 + c.gspo.eps_high
        s = _exp(mean_log_r)
        weight = jax.lax.stop_gradient(s)
        if c.objective == "gspo_token":
            s = weight * grad_lp
        pg = jnp.minimum(s * adv, jnp.clip(s, lo, hi) * adv)
        if c.gspo.norm == "sequence":  # GSPO's 1/|y| inside each sequence
            pg = pg / n_seq * (1.0 if seq_scale is None else seq_scale)
    loss = -jnp.where(keep, cfg.adv_tau * pg, 0.0) + cfg.kl_tau * jnp.where(member, log_r * log_r, 0.0)
    kept_in_seq = seq_sum(keep.astype(lp.dtype), seg)
    info = {
        "weight": jnp.where(member, jax.lax.stop_gradient(weight), 0.0),
        "masked": member & ~keep,
        "rejected": rejected,
        "seq_first": seq_first(member, seg),  # one token per sequence: counts sequences
        "seq_all_masked": member & (kept_in_seq == 0),
        "seq_log_ratio": jax.lax.stop_gradient(mean_log_r),
        "masked_low": masked_low,
        "masked_high": masked_high,
    }
    return loss, info


def _stream(mb: Mapping[str, jax.Array], name: str) -> jax.Array:
    """An int stream of the batch; absent (a hand-built batch) = 0 everywhere (env 0, on-policy)."""
    return mb[name] if name in mb else jnp.zeros(mb["loss_mask"].shape, jnp.int32)


def kind_ids(env_ids: jax.Array, table: CorrectionTable) -> jax.Array:
    return jnp.asarray(table.env_kind, jnp.int32)[jnp.clip(env_ids, 0, len(table.env_kind) - 1)]


def step_norms(lp, mb: Mapping[str, jax.Array], member, table: CorrectionTable) -> dict[str, jax.Array]:
    """This micro-batch's share of every normalized correction's (weight sum, count): `is_norm/{k}` [2]."""
    kinds = kind_ids(_stream(mb, "env_ids"), table)
    out = {}
    for k, c in enumerate(table.kinds):
        if c.is_weight.normalize:
            s, n = norm_sums(lp, mb["inference_logprobs"], member & (kinds == k), mb["segment_ids"], c)
            out[f"is_norm/{k}"] = jnp.stack([s, n])
    return out


def table_loss(
    lp,
    mb: Mapping[str, jax.Array],
    member,
    cfg: LossConfig,
    table: CorrectionTable,
    counts: Mapping[str, jax.Array],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token rl loss over every correction of the table, and the merged per-token indicators."""
    lq, adv, seg = mb["inference_logprobs"], mb["advantages"], mb["segment_ids"]
    if len(table.kinds) == 1:
        members = [member]
    else:
        kinds = kind_ids(_stream(mb, "env_ids"), table)
        members = [member & (kinds == k) for k in range(len(table.kinds))]
    loss, info = None, None
    for k, (c, m) in enumerate(zip(table.kinds, members, strict=True)):
        norm = None
        if c.is_weight.normalize:
            s, n = counts[f"is_norm/{k}"][0], counts[f"is_norm/{k}"][1]
            norm = jnp.where(n > 0, s / jnp.maximum(n, 1e-30), 1.0).astype(lp.dtype)
        seq_scale = None
        if c.objective in ("gspo", "gspo_token") and c.gspo.norm == "sequence":
            n_rl, n_seqs = (jnp.maximum(counts[key], 1.0).astype(lp.dtype) for key in ("rl", "seqs/rl"))
            seq_scale = n_rl / n_seqs  # divided in lp's dtype: the counts are exact fp32 integers
        tok, ind = token_loss(lp, lq, adv, m, seg, c, cfg, norm, seq_scale)
        if loss is None:
            loss, info = tok, ind
        else:  # each kind is zero outside its own members
            loss = loss + tok
            info = {key: (info[key] | v) if v.dtype == jnp.bool_ else info[key] + v for key, v in ind.items()}
    return loss, info


def metric_sums(
    info, member, log_r_sg, mb: Mapping[str, jax.Array], table: CorrectionTable
) -> dict[str, jax.Array]:
    """Additive sums (keys `max/...` combine by maximum) for the per-env, per-staleness and histogram metrics."""
    f32 = jnp.float32
    mism = jnp.where(member, jnp.expm1(log_r_sg) - log_r_sg, 0.0)
    w = info["weight"]
    out: dict[str, jax.Array] = {}

    def add(prefix: str, sel: jax.Array) -> None:
        out[f"corr/{prefix}/tokens"] = jnp.sum(sel, dtype=f32)
        out[f"corr/{prefix}/seqs"] = jnp.sum(sel & info["seq_first"], dtype=f32)
        out[f"corr/{prefix}/weight"] = jnp.sum(jnp.where(sel, w, 0.0), dtype=f32)
        out[f"max/corr/{prefix}/weight"] = jnp.max(jnp.where(sel, w, 0.0)).astype(f32)
        out[f"corr/{prefix}/masked"] = jnp.sum(sel & info["masked"], dtype=f32)
        out[f"corr/{prefix}/rejected"] = jnp.sum(sel & info["rejected"], dtype=f32)
        out[f"corr/{prefix}/seq_masked"] = jnp.sum(
            sel & info["seq_first"] & info["seq_all_masked"], dtype=f32
        )
        out[f"corr/{prefix}/mismatch_kl"] = jnp.sum(jnp.where(sel, mism, 0.0), dtype=f32)

    env_ids = _stream(mb, "env_ids")
    for e, name in enumerate(table.env_names):
        add(f"env/{name}", member & (env_ids == e) if len(table.env_names) > 1 else member)
    stale = jnp.clip(_stream(mb, "staleness"), 0, table.staleness_bins - 1)
    for s in range(table.staleness_bins):
        add(f"staleness/{s}", member & (stale == s))
    # Histogram of sequences over their mean log-ratio (each sequence counts once, via its members' shares).
    x = info["seq_log_ratio"]
    lower = -jnp.inf
    for i, upper in enumerate((*HIST_EDGES, jnp.inf)):
        sel = member & (x > lower) & (x <= upper)
        out[f"corr/hist/{i}"] = jnp.sum(sel & info["seq_first"], dtype=f32)
        lower = upper
    return out


def hist_labels() -> list[str]:
    """Bin i of `corrections/seq_log_ratio_hist/<i>` holds mean log-ratios in (edge[i-1], edge[i]]."""
    edges = ("-inf", *map(str, HIST_EDGES), "inf")
    return [f"({edges[i]}, {edges[i + 1]}]" for i in range(len(edges) - 1)]


def finalize(sums: Mapping[str, jax.Array], table: CorrectionTable) -> dict[str, jax.Array]:
    """Logged metrics: `corrections/{env/<name> | staleness/<s>}/{is_weight_mean, is_weight_max,
    masked_frac, rejected_frac, seq_masked_frac, mismatch_kl, tokens}` and `corrections/seq_log_ratio_hist/<bin>`
    (share of sequences whose mean log(pi/mu) falls in the bin)."""
    out = {}
    groups = [f"env/{n}" for n in table.env_names] + [f"staleness/{s}" for s in range(table.staleness_bins)]
    for g in groups:
        n = jnp.maximum(sums[f"corr/{g}/tokens"], 1.0)
        seqs = jnp.maximum(sums[f"corr/{g}/seqs"], 1.0)
        base = f"corrections/{g}"
        out[f"{base}/tokens"] = sums[f"corr/{g}/tokens"]
        out[f"{base}/is_weight_mean"] = sums[f"corr/{g}/weight"] / n
        out[f"{base}/is_weight_max"] = sums[f"max/corr/{g}/weight"]
        out[f"{base}/masked_frac"] = sums[f"corr/{g}/masked"] / n
        out[f"{base}/rejected_frac"] = sums[f"corr/{g}/rejected"] / n
        out[f"{base}/seq_masked_frac"] = sums[f"corr/{g}/seq_masked"] / seqs
        out[f"{base}/mismatch_kl"] = sums[f"corr/{g}/mismatch_kl"] / n
    total = jnp.maximum(sum(sums[f"corr/hist/{i}"] for i in range(len(HIST_EDGES) + 1)), 1.0)
    for i in range(len(HIST_EDGES) + 1):
        out[f"corrections/seq_log_ratio_hist/{i:02d}"] = sums[f"corr/hist/{i}"] / total
    return out


def merge_sums(a: Mapping[str, jax.Array], b: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Combine two micro-batches' metric sums: `max/...` keys by maximum, the rest by addition."""
    return {k: jnp.maximum(a[k], b[k]) if k.startswith("max/") else a[k] + b[k] for k in a}
