"""The training loss: three components (rl, ce, ref_kl), each normalized by its own global token count.

Per token, with lp = trainer logprob, lq = inference logprob, A = advantage, log_r = lp - lq, r = exp(log_r),
d = exp(lp) - exp(lq) (docs/architecture.md#losses):

- rl (DPPO + KL): masked = (A > 0 and d > dppo_mask_high) or (A <= 0 and d < -dppo_mask_low);
  loss_t = -keep * adv_tau * A * min(r, is_clip) + kl_tau * member * log_r^2, keep = member and not masked.
  Each environment's algorithm block may replace the policy-gradient term and add masks (off-policy
  corrections: IS weights, MIS, icepop, GSPO, CISPO; trainer/corrections.py, docs/algorithms.md#corrections).
- ce: loss_t = -member * lp.
- ref_kl: masked = d < -dppo_mask_low; loss_t = -keep * sg(lref - lp) * r + kl_tau * member * log_r^2.

A token is a member of component c when `loss_mask` and `w_c != 0`; its loss is scaled by w_c. The step's
loss is sum_c (sum over the whole step of loss_t) / max(N_c, 1), where N_c counts the members of c across
every micro-batch (and data-parallel shard). The step computes N_c before the micro-batch loop and every
micro-batch adds its already-normalized share, so the result and its gradient do not depend on the split.

Every array here is [B, T] and already aligned so that index t is the target predicted from hidden state t
(see `primejax.trainer.step.shift_targets`).

A registered rl objective (`trainer.loss.type = <its name>`, or `custom` + `import_path`) replaces the rl
component: one function called once per sequence (packed segment), objectives.py has its signature and rules.
Its metrics are averaged over the sequences that have rl tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from primejax.contracts.batch import LOSS_COMPONENTS as COMPONENTS
from primejax.trainer import corrections
from primejax.trainer.config import LossConfig
from primejax.trainer.corrections import CorrectionTable
from primejax.trainer.objectives import LossFn, LossInputs, objective


def member_masks(batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Per component: loss_mask and a non-zero weight."""
    return {c: batch["loss_mask"] & (batch[f"{c}_weights"] != 0) for c in COMPONENTS}


def global_counts(batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """N_c over every token of the arrays given (pass the whole step), as fp32 scalars, and `seqs/rl`, the
    sequences (packed segments) with an rl member: GSPO's per-sequence normalization needs the step's count."""
    members = member_masks(batch)
    counts = {c: jnp.sum(m, dtype=jnp.float32) for c, m in members.items()}
    counts["seqs/rl"] = jnp.sum(corrections.seq_first(members["rl"], batch["segment_ids"]), dtype=jnp.float32)
    return counts


def _kl_term(log_r: jax.Array, member: jax.Array, kl_tau: float) -> jax.Array:
    return kl_tau * jnp.where(member, log_r * log_r, 0.0)


def ref_kl_token_loss(lp, lq, lref, member, cfg: LossConfig) -> tuple[jax.Array, jax.Array]:
    log_r = jnp.where(member, lp - lq, 0.0)
    r = jnp.exp(log_r)
    d = jnp.exp(lp) - jnp.exp(lq)
    masked_low = member & (d < -cfg.dppo_mask_low)
    keep = member & ~masked_low
    pg = jnp.where(keep, jax.lax.stop_gradient(lref - lp) * r, 0.0)
    return -pg + _kl_term(log_r, member, cfg.kl_tau), masked_low


def _custom_rl(fn: LossFn, kwargs: dict, lp, mb, member, max_segments: int):
    """Sum over sequences of fn(sequence) and per-metric sums over sequences that have rl tokens."""
    seg_ids = jnp.arange(1, max_segments + 1, dtype=mb["segment_ids"].dtype)

    def one(lp_t, lq_t, lref_t, adv_t, w_t, member_t, seg_t, s):
        mask = member_t & (seg_t == s)
        out = fn(LossInputs(lp_t, lq_t, lref_t, adv_t, mask, w_t), **kwargs)
        present = jnp.any(mask)
        metrics = {k: jnp.where(present, jnp.asarray(v, jnp.float32), 0.0) for k, v in out.metrics.items()}
        return jnp.where(present, out.loss, 0.0), metrics, present.astype(jnp.float32)

    per_seg = jax.vmap(one, in_axes=(None,) * 7 + (0,))
    per_row = jax.vmap(per_seg, in_axes=(0,) * 7 + (None,))
    loss, metrics, present = per_row(
        lp,
        mb["inference_logprobs"],
        mb["ref_logprobs"],
        mb["advantages"],
        mb["rl_weights"],
        member,
        mb["segment_ids"],
        seg_ids,
    )
    sums = {f"custom/{k}": jnp.sum(v) for k, v in metrics.items()}
    sums["custom/num_sequences"] = jnp.sum(present)
    return jnp.sum(loss), sums


def make_loss_fn(
    cfg: LossConfig, max_segments: int = 0, table: CorrectionTable | None = None
) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """Build loss(lp, entropy, micro_batch, counts) -> (normalized loss share, additive metric sums).

    `max_segments` bounds the packed sequences per row (a custom loss iterates over them). `table`: the
    off-policy corrections of the rl component per environment (corrections.py; default: plain DPPO + KL).
    Metric sums are additive over micro-batches except `max/...` keys (`corrections.merge_sums`).
    """
    table = table or CorrectionTable()
    custom = objective(cfg.type, cfg.import_path)  # None: the default DPPO + KL with its corrections
    kwargs = cfg.kwargs

    def loss_fn(lp, entropy, mb, counts):
        members = member_masks(mb)
        lq = mb["inference_logprobs"]
        sums: dict[str, jax.Array] = {}
        total = jnp.zeros((), jnp.float32)

        if custom is None:
            rl_tok, ind = corrections.table_loss(lp, mb, members["rl"], cfg, table, counts)
            rl_sum = jnp.sum(mb["rl_weights"] * rl_tok)
            sums["masked_low"] = jnp.sum(ind["masked_low"], dtype=jnp.float32)
            sums["masked_high"] = jnp.sum(ind["masked_high"], dtype=jnp.float32)
            log_r_rl = jnp.where(members["rl"], jax.lax.stop_gradient(lp) - lq, 0.0)
            sums.update(corrections.metric_sums(ind, members["rl"], log_r_rl, mb, table))
        else:
            rl_sum, custom_sums = _custom_rl(custom, kwargs, lp, mb, members["rl"], max_segments)
            sums.update(custom_sums)
        ce_sum = jnp.sum(jnp.where(members["ce"], -mb["ce_weights"] * lp, 0.0))
        ref_tok, ref_masked = ref_kl_token_loss(lp, lq, mb["ref_logprobs"], members["ref_kl"], cfg)
        ref_sum = jnp.sum(mb["ref_kl_weights"] * ref_tok)
        sums["ref_kl_masked_low"] = jnp.sum(ref_masked, dtype=jnp.float32)

        for c, s in zip(COMPONENTS, (rl_sum, ce_sum, ref_sum), strict=True):
            share = s / jnp.maximum(counts[c], 1.0)
            sums[f"loss/{c}"] = share
            total = total + share

        # Diagnostics (no gradient): over the tokens the policy sampled (rl and ref_kl members use lq).
        lp_sg = jax.lax.stop_gradient(lp)
        sampled = members["rl"] | members["ref_kl"]
        log_r = jnp.where(sampled, lp_sg - lq, 0.0)
        # expm1: exp(x) - 1 - x cancels catastrophically in fp32 for the tiny |x| of a well-synced policy.
        sums["mismatch_kl"] = jnp.sum(jnp.where(sampled, jnp.expm1(log_r) - log_r, 0.0))
        sums["num_sampled"] = jnp.sum(sampled, dtype=jnp.float32)
        sums["entropy"] = jnp.sum(jnp.where(mb["loss_mask"], jax.lax.stop_gradient(entropy), 0.0))
        sums["num_loss_tokens"] = jnp.sum(mb["loss_mask"], dtype=jnp.float32)
        return total, sums

    return loss_fn


def finalize_metrics(
    sums: Mapping[str, jax.Array], counts: Mapping[str, jax.Array], table: CorrectionTable | None = None
) -> dict[str, jax.Array]:
    """Turn the step's accumulated sums into logged metrics (still arrays: no host sync)."""

    def mean(num, den):
        return num / jnp.maximum(den, 1.0)

    out = {f"loss/{c}": sums[f"loss/{c}"] for c in COMPONENTS}
    out["entropy"] = mean(sums["entropy"], sums["num_loss_tokens"])
    out["mismatch_kl"] = mean(sums["mismatch_kl"], sums["num_sampled"])
    if "masked_low" in sums:
        out["masked_low_frac"] = mean(sums["masked_low"], counts["rl"])
        out["masked_high_frac"] = mean(sums["masked_high"], counts["rl"])
    if "corr/hist/0" in sums:
        out.update(corrections.finalize(sums, table or CorrectionTable()))
    out["ref_kl_masked_low_frac"] = mean(sums["ref_kl_masked_low"], counts["ref_kl"])
    for c in COMPONENTS:
        out[f"tokens/{c}"] = counts[c]
    out["tokens/loss"] = sums["num_loss_tokens"]
    n_seq = sums.get("custom/num_sequences")
    for k, v in sums.items():
        if k.startswith("custom/") and k != "custom/num_sequences":
            out[k] = mean(v, n_seq)
    return out
