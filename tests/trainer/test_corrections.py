"""Off-policy corrections of the rl loss (trainer/corrections.py) against a NumPy float64 transcription of
docs/algorithms.md#corrections, written per sequence with explicit loops (no segment-sum tricks).

Stop-gradient parts are evaluated at a frozen copy `lp0` of the trainer logprobs, so the reference's finite
differences in `lp` (lp0 fixed) are exactly the gradient the trainer computes. Every check runs in float64
(`jax.enable_x64`) at 1e-10.
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
from primejax.trainer.corrections import CorrectionTable, merge_sums, step_norms
from primejax.trainer.losses import LossConfig, finalize_metrics, global_counts, make_loss_fn, member_masks
from primejax.utils.sections import ConfigError

LOSS = LossConfig(dppo_mask_low=0.2, dppo_mask_high=0.2, adv_tau=0.9, kl_tau=0.05, is_clip=3.0)
TOL = 1e-10


# ------------------------------------------------------------------------------------------ reference


def _sequences(b):
    """(row, positions of the sequence's rl members) for every packed sequence, padding excluded."""
    member = b["loss_mask"] & (b["rl_weights"] != 0)
    out = []
    for row in range(b["segment_ids"].shape[0]):
        for s in np.unique(b["segment_ids"][row]):
            if s > 0:
                out.append((row, np.nonzero((b["segment_ids"][row] == s) & member[row])[0]))
    return out


def _clip(x, lo, hi):
    return np.minimum(np.maximum(x, lo), hi)


def np_corr_loss(lp, lp0, b, corr_of_env, cfg: LossConfig = LOSS):
    """The rl component (sum over tokens / N_rl) with each env's correction; sg parts at lp0."""
    lq, adv, w_rl, env = b["inference_logprobs"], b["advantages"], b["rl_weights"], b["env_ids"]
    n_rl = max(int((b["loss_mask"] & (w_rl != 0)).sum()), 1)
    seqs = _sequences(b)
    n_seqs = max(sum(1 for _, idx in seqs if len(idx)), 1)
    # 1. per sequence: acceptance and raw IS weights (from lp0), per env kind
    info = []
    for row, idx in seqs:
        c = corr_of_env[int(env[row, idx[0]])] if len(idx) else None
        lr0 = lp0[row, idx] - lq[row, idx]
        r0 = np.exp(lr0)
        acc = np.ones(len(idx), bool)
        if c is not None and c.reject.level != "none":
            d = lr0 if c.reject.divergence == "k1" else r0 - 1 - lr0
            if c.reject.level == "sequence":  # the sum: k1 = log of the product of the ratios
                d = np.full(len(idx), d.sum())
            elif c.reject.level == "geometric":
                d = np.full(len(idx), d.mean())
            acc &= (d >= c.reject.low) & (d <= c.reject.high)
        if c is not None and c.icepop.enabled:
            acc &= (r0 >= c.icepop.low) & (r0 <= c.icepop.high)
        w = None
        if c is not None and c.is_weight.level != "none":
            cap = c.is_weight.cap
            level = c.is_weight.level
            if level == "token":
                w = np.minimum(r0, cap)
            elif level == "sequence":
                w = np.full(len(idx), min(np.exp(lr0.sum()), cap))
            else:
                w = np.full(len(idx), min(np.exp(lr0.mean()), cap))
        info.append((row, idx, c, acc, w))
    # 2. the step's mean weight per correction (tokens, or sequences with an accepted token)
    norms = {}
    for c in {i[2] for i in info if i[2] is not None and i[2].is_weight.normalize}:
        vals = []
        for _, _, ci, acc, w in info:
            if ci == c and acc.any():
                vals += list(w[acc]) if c.is_weight.level == "token" else [w[0]]
        norms[c] = np.mean(vals) if vals else 1.0
    # 3. per token loss
    total = 0.0
    for row, idx, c, acc, w in info:
        if c is None:
            continue
        lpt, lp0t, lqt, a = lp[row, idx], lp0[row, idx], lq[row, idx], adv[row, idx]
        lr = lpt - lqt
        keep = acc.copy()
        r0 = np.exp(lp0t - lqt)
        if c.objective == "dppo" or (c.objective == "cispo" and c.cispo.mask == "dppo"):
            d = np.exp(lp0t) - np.exp(lqt)
            keep &= ~(((a > 0) & (d > cfg.dppo_mask_high)) | ((a <= 0) & (d < -cfg.dppo_mask_low)))
        elif c.objective == "cispo" and c.cispo.mask == "ratio":  # MiniMax-M1's M_t
            m = c.cispo
            keep &= ~(((a > 0) & (r0 > 1 + m.mask_eps_high)) | ((a <= 0) & (r0 < 1 - m.mask_eps_low)))
        if c.objective == "dppo" and w is None and c.icepop.enabled:
            pg = a * np.exp(lr)  # IcePop: kept tokens weigh r, whatever is_clip
        elif c.objective == "dppo" and w is None:
            pg = a * np.minimum(np.exp(lr), cfg.is_clip)
        elif c.objective == "dppo":
            wt = w / norms[c] if c.is_weight.normalize else w
            pg = a * wt * np.exp(lpt - lp0t)
        elif c.objective == "cispo":
            pg = _clip(r0, max(0.0, 1 - c.cispo.eps_low), 1 + c.cispo.eps_high) * a * lpt
        else:
            lo, hi = 1 - c.gspo.eps_low, 1 + c.gspo.eps_high
            if c.objective == "gspo":
                s = np.exp(lr.mean()) if len(lr) else 1.0
            else:
                s = np.exp((lp0t - lqt).mean()) * np.exp(lpt - lp0t)
            pg = np.minimum(s * a, _clip(s, lo, hi) * a)
            if c.gspo.norm == "sequence":  # GSPO: mean over the sequence's tokens, then over sequences
                pg = pg / len(idx) * n_rl / n_seqs
        tok = -1.0 * keep * cfg.adv_tau * pg + cfg.kl_tau * lr**2
        total += np.sum(w_rl[row, idx] * tok)
    return total / n_rl


def np_grad(lp0, b, corr_of_env, h=2e-4):
    """d loss / d lp by a 4-point central difference (O(h^4)), stop-gradient parts frozen at lp0."""
    g = np.zeros_like(lp0)
    member = b["loss_mask"] & (b["rl_weights"] != 0)
    for i, j in zip(*np.nonzero(member), strict=True):

        def f(delta, i=i, j=j):
            x = lp0.copy()
            x[i, j] += delta
            return np_corr_loss(x, lp0, b, corr_of_env)

        g[i, j] = (8 * (f(h) - f(-h)) - (f(2 * h) - f(-2 * h))) / (12 * h)
    return g


# ------------------------------------------------------------------------------------------ batch


def make_batch(seed=0):
    """3 packed rows: several sequences per row, padding, prompt tokens, weight-0 and half-weight tokens, a
    zero-advantage sequence, a sequence without rl members, and one far off-policy sequence."""
    rng = np.random.default_rng(seed)
    b_, t_ = 3, 24
    seg = np.zeros((b_, t_), np.int32)
    layout = [[10, 8], [24], [6, 12, 6]]  # row 0 ends in 6 padding tokens
    for r, lens in enumerate(layout):
        o = 0
        for s, n in enumerate(lens, start=1):
            seg[r, o : o + n] = s
            o += n
    pos = np.zeros_like(seg)
    loss_mask = np.zeros((b_, t_), bool)
    adv = np.zeros((b_, t_))
    env = np.zeros((b_, t_), np.int32)
    stale = np.zeros((b_, t_), np.int32)
    seq_adv = iter([1.3, -0.7, 0.8, 0.0, -1.1, 0.6])
    for r in range(b_):
        for s in range(1, seg[r].max() + 1):
            idx = np.nonzero(seg[r] == s)[0]
            pos[r, idx] = np.arange(len(idx))
            loss_mask[r, idx[3:]] = True  # 3 prompt tokens
            adv[r, idx] = next(seq_adv)
            env[r, idx] = (r + s) % 2
            stale[r, idx] = (r * 3 + s) % 3
    loss_mask[2, seg[2] == 1] = False  # row 2, sequence 1: no rl member at all
    loss_mask[1, 20] = False
    rl_w = np.where(rng.random((b_, t_)) < 0.15, 0.0, 1.0)
    rl_w[rng.random((b_, t_)) < 0.15] = 0.5
    lq = np.log(rng.uniform(0.05, 0.95, (b_, t_)))
    lp = lq + rng.normal(scale=0.25, size=(b_, t_))
    lp[0, seg[0] == 2] = lq[0, seg[0] == 2] + 1.5  # far off-policy: a sequence MIS rejects whole
    lp = np.minimum(lp, -1e-3)
    real = seg > 0
    b = {
        "loss_mask": loss_mask,
        "inference_logprobs": np.where(real, lq, 0.0),
        "advantages": adv,
        "ref_logprobs": np.zeros((b_, t_)),
        "rl_weights": rl_w,
        "ce_weights": np.zeros((b_, t_)),
        "ref_kl_weights": np.zeros((b_, t_)),
        "segment_ids": seg,
        "positions": pos,
        "env_ids": env,
        "staleness": stale,
    }
    return np.where(real, lp, 0.0), b


# ------------------------------------------------------------------------------------------ jax side


def _table(corr_of_env):
    kinds, env_kind = [], []
    for c in corr_of_env:
        if c not in kinds:
            kinds.append(c)
        env_kind.append(kinds.index(c))
    return CorrectionTable(tuple(kinds), tuple(env_kind), tuple(f"e{i}" for i in range(len(corr_of_env))))


def _counts(lp, jb, table):
    counts = global_counts(jb)
    counts.update(step_norms(jnp.asarray(lp), jb, member_masks(jb)["rl"], table))
    return counts


def jax_loss(lp, b, corr_of_env, rows=None):
    """(rl loss share, metric sums) of `rows` (default all), normalized with the whole batch's counts."""
    table = _table(corr_of_env)
    jb = {k: jnp.asarray(v) for k, v in b.items()}
    counts = _counts(lp, jb, table)
    fn = make_loss_fn(LOSS, 0, table)
    sub = slice(None) if rows is None else rows
    mb = {k: v[sub] for k, v in jb.items()}
    x = jnp.asarray(lp)[sub]
    loss, sums = fn(x, jnp.zeros_like(x), mb, counts)
    return sums["loss/rl"], sums, counts, table


TIS = CorrectionConfig(is_weight=ISWeightConfig(level="token", cap=1.5))
CASES = {
    "dppo": CorrectionConfig(),
    "tis_token": TIS,
    "tis_token_normalized": CorrectionConfig(
        is_weight=ISWeightConfig(level="token", cap=1.5, normalize=True)
    ),
    "is_sequence": CorrectionConfig(is_weight=ISWeightConfig(level="sequence", cap=3.0)),
    "is_sequence_normalized": CorrectionConfig(
        is_weight=ISWeightConfig(level="sequence", cap=3.0, normalize=True)
    ),
    "is_geometric_normalized": CorrectionConfig(
        is_weight=ISWeightConfig(level="geometric", cap=1.2, normalize=True)
    ),
    "mis_token_k1": CorrectionConfig(reject=RejectConfig(level="token", divergence="k1", low=-0.3, high=0.3)),
    "mis_geometric_k3": CorrectionConfig(
        reject=RejectConfig(level="geometric", divergence="k3", low=0.0, high=0.1)
    ),
    "mis_sequence_k3": CorrectionConfig(
        reject=RejectConfig(level="sequence", divergence="k3", low=0.0, high=0.5)
    ),
    # Seq-MIS (Liu, Li et al. 2025): keep a sequence iff its ratio product is in [1/2, 2], weigh it by that product
    "seq_mis": CorrectionConfig(
        is_weight=ISWeightConfig(level="sequence", cap=2.0),
        reject=RejectConfig(level="sequence", divergence="k1", low=-0.693, high=0.693),
    ),
    "mis_sequence_k1_with_tis": CorrectionConfig(
        is_weight=ISWeightConfig(level="token", cap=1.5, normalize=True),
        reject=RejectConfig(level="sequence", divergence="k1", low=-0.5, high=0.5),
    ),
    "icepop": CorrectionConfig(icepop=IcepopConfig(enabled=True, low=0.8, high=1.25)),
    "gspo": CorrectionConfig(objective="gspo", gspo=GspoConfig(eps_low=0.05, eps_high=0.07)),
    "gspo_mis_sequence": CorrectionConfig(
        objective="gspo",
        gspo=GspoConfig(eps_low=0.05, eps_high=0.07),
        reject=RejectConfig(level="sequence", divergence="k3", low=0.0, high=0.1),
    ),
    "gspo_token_icepop": CorrectionConfig(
        objective="gspo_token",
        gspo=GspoConfig(eps_low=0.05, eps_high=0.07),
        icepop=IcepopConfig(enabled=True, low=0.8, high=1.25),
    ),
    "cispo": CorrectionConfig(objective="cispo", cispo=CispoConfig(eps_low=0.2, eps_high=0.2)),
    "cispo_icepop": CorrectionConfig(
        objective="cispo", icepop=IcepopConfig(enabled=True, low=0.8, high=1.25)
    ),
}


def _check(lp, b, corr_of_env):
    with jax.enable_x64(True):
        loss, sums, counts, table = jax_loss(lp, b, corr_of_env)
        ref = np_corr_loss(lp, lp, b, corr_of_env)
        assert abs(float(loss) - ref) <= TOL * max(1.0, abs(ref)), (float(loss), ref)
        g = np.asarray(jax.grad(lambda x: jax_loss(x, b, corr_of_env)[0])(jnp.asarray(lp)))
    np.testing.assert_allclose(g, np_grad(lp, b, corr_of_env), rtol=0, atol=TOL)
    return sums, counts, table


@pytest.mark.parametrize("name", list(CASES))
def test_correction_loss_and_gradient_match_numpy_fp64(name):
    lp, b = make_batch()
    c = CASES[name]
    sums, counts, table = _check(lp, b, [c, c])
    with jax.enable_x64(True):
        metrics = finalize_metrics(sums, counts, table)
    assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())


def test_two_envs_with_different_corrections_add_up():
    """Env 0 runs GSPO, env 1 TIS + sequence MIS, in the same rows: each over its own tokens."""
    lp, b = make_batch(1)
    _check(lp, b, [CASES["gspo"], CASES["mis_sequence_k1_with_tis"]])


@pytest.mark.parametrize("name", ["tis_token_normalized", "is_sequence_normalized", "gspo", "cispo_icepop"])
def test_loss_does_not_depend_on_the_micro_batch_split(name):
    """Rows as one micro-batch or one per row (counts and weight means over the whole step): same loss share
    sum and gradient (fp64, 1e-10) and metrics (max/ keys by maximum)."""
    lp, b = make_batch(2)
    envs = [CASES[name], CASES["tis_token_normalized"]]
    with jax.enable_x64(True):
        whole, sums, _, _ = jax_loss(lp, b, envs)
        parts = [jax_loss(lp, b, envs, rows=slice(r, r + 1)) for r in range(3)]
        assert abs(float(sum(p[0] for p in parts)) - float(whole)) <= TOL
        merged = parts[0][1]
        for p in parts[1:]:
            merged = merge_sums(merged, p[1])
        for k in sums:  # metric sums are float32 (summation order differs): 1e-6
            np.testing.assert_allclose(merged[k], sums[k], rtol=1e-6, atol=1e-6, err_msg=k)
        g_whole = jax.grad(lambda x: jax_loss(x, b, envs)[0])(jnp.asarray(lp))
        g_parts = sum(
            jax.grad(lambda x, r=r: jax_loss(x, b, envs, rows=slice(r, r + 1))[0])(jnp.asarray(lp))
            for r in range(3)
        )
        np.testing.assert_allclose(g_parts, g_whole, rtol=0, atol=TOL)


def test_edge_cases_empty_all_masked_zero_advantage():
    """No rl member at all; every sequence rejected; all advantages zero: finite, loss = the KL term only."""
    lp, b = make_batch(3)
    mis = CorrectionConfig(
        reject=RejectConfig(level="sequence", divergence="k1", low=5.0, high=6.0),
        is_weight=ISWeightConfig(level="token", normalize=True),
    )
    for variant, corr in (
        ({"loss_mask": np.zeros_like(b["loss_mask"])}, CASES["tis_token_normalized"]),
        ({}, mis),  # every sequence rejected: no accepted weight, norm falls back to 1
        ({"advantages": np.zeros_like(b["advantages"])}, CASES["gspo"]),
        ({"rl_weights": np.zeros_like(b["rl_weights"])}, CASES["cispo"]),
    ):
        bb = {**b, **variant}
        sums, counts, table = _check(lp, bb, [corr, corr])
        with jax.enable_x64(True):
            metrics = finalize_metrics(sums, counts, table)
        assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())
    with jax.enable_x64(True):
        _, sums, counts, table = jax_loss(lp, b, [mis, mis])
        m = finalize_metrics(sums, counts, table)
    for e in ("e0", "e1"):
        assert float(m[f"corrections/env/{e}/rejected_frac"]) == 1.0
        assert float(m[f"corrections/env/{e}/seq_masked_frac"]) == pytest.approx(1.0)


def test_metrics_per_env_staleness_and_histogram():
    lp, b = make_batch(4)
    envs = [CASES["mis_geometric_k3"], CASES["tis_token"]]
    with jax.enable_x64(True):
        _, sums, counts, table = jax_loss(lp, b, envs)
        m = {k: float(v) for k, v in finalize_metrics(sums, counts, table).items()}  # float32 metrics: 1e-6
    member = b["loss_mask"] & (b["rl_weights"] != 0)
    r = np.exp(lp - b["inference_logprobs"])
    # env 1 (TIS): weight = min(r, cap) on its tokens
    sel = member & (b["env_ids"] == 1)
    assert m["corrections/env/e1/is_weight_mean"] == pytest.approx(np.minimum(r[sel], 1.5).mean(), rel=1e-6)
    assert m["corrections/env/e1/is_weight_max"] == pytest.approx(np.minimum(r[sel], 1.5).max(), rel=1e-6)
    assert m["corrections/env/e1/tokens"] == sel.sum()
    # env 0 (geometric MIS on k3): rejected tokens are those of sequences whose mean k3 > 0.1
    sel0 = member & (b["env_ids"] == 0)
    rejected, seqs, seqs_rej = 0, 0, 0
    for row, idx in _sequences(b):
        if len(idx) and b["env_ids"][row, idx[0]] == 0:
            k3 = (r[row, idx] - 1 - np.log(r[row, idx])).mean()
            seqs += 1
            if k3 > 0.1:
                rejected += len(idx)
                seqs_rej += 1
    assert 0 < rejected < sel0.sum()
    assert m["corrections/env/e0/rejected_frac"] == pytest.approx(rejected / sel0.sum(), rel=1e-6)
    assert m["corrections/env/e0/seq_masked_frac"] >= seqs_rej / seqs - 1e-12
    # staleness bins partition the members; mismatch KL per bin
    total = sum(m[f"corrections/staleness/{s}/tokens"] for s in range(table.staleness_bins))
    assert total == member.sum()
    s1 = member & (b["staleness"] == 1)
    kl = (r[s1] - 1 - np.log(r[s1])).mean()
    assert m["corrections/staleness/1/mismatch_kl"] == pytest.approx(kl, rel=1e-6)
    hist = [m[k] for k in sorted(m) if k.startswith("corrections/seq_log_ratio_hist/")]
    assert sum(hist) == pytest.approx(1.0, rel=1e-6) and max(hist) < 1.0


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"objective": "gspo", "is_weight": ISWeightConfig(level="token")}, "is_weight.level"),
        ({"objective": "cispo", "is_weight": ISWeightConfig(level="sequence")}, "is_weight.level"),
        ({"is_weight": ISWeightConfig(normalize=True)}, "is_weight.normalize"),
        ({"objective": "gspo", "icepop": IcepopConfig(enabled=True)}, "icepop.enabled"),
        ({"objective": "gspo", "reject": RejectConfig(level="token")}, "reject.level"),
    ],
)
def test_incompatible_combinations_are_one_line_errors(changes, key):
    with pytest.raises(ConfigError) as e:
        CorrectionConfig(**changes)
    assert e.value.key == key and "\n" not in str(e.value)


def test_reject_and_icepop_ranges_are_checked():
    with pytest.raises(ConfigError, match="below high"):
        RejectConfig(low=0.5, high=0.1)
    with pytest.raises(ConfigError, match="below high"):
        IcepopConfig(low=2.0, high=1.0)


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): two more compiled steps
def test_step_with_normalized_weights_does_not_depend_on_the_micro_batch_split(tiny_cfg, make_samples):
    """The jitted step's gradient accumulation with two envs (normalized TIS + sequence MIS, GSPO-token): the
    forward-only pre-pass gives every micro-batch the whole step's mean weight, so 1x4 and 4x1 agree."""
    from flax import nnx

    from primejax.contracts.batch import pack_samples
    from primejax.models.transformer import init_model
    from primejax.trainer.step import make_grad_fn, target_logprobs, to_micro_batches

    samples = make_samples(5, 8, max_len=24, streams=False)
    for i, s in enumerate(samples):
        s.env_index, s.policy_version = i % 2, i % 3
    (batch,) = pack_samples(samples, seq_len=48, pad_rows_to_multiple=4, step=3, envs=("a", "b"))
    assert batch.rows == 4 and set(np.unique(batch.staleness[batch.loss_mask])) == {0, 1, 2}
    table = _table([CASES["mis_sequence_k1_with_tis"], CASES["gspo_token_icepop"]])
    model = init_model(tiny_cfg, None, seed=0)
    # a sampler near the policy: its logprobs plus noise, so every mask keeps some tokens and drops others
    lq = np.asarray(target_logprobs(model, batch.arrays())) + np.random.default_rng(0).normal(
        0, 0.3, batch.tokens.shape
    )
    batch.inference_logprobs = np.where(batch.loss_mask, lq, 0.0).astype(np.float32)
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    fn = jax.jit(make_grad_fn(graphdef, LossConfig(kl_tau=0.1), chunk_size=16, corrections=table))
    results = {m: fn(params, to_micro_batches(batch, m)) for m in (4, 1)}
    loss4, grads4, sums4, counts4 = results[4]
    assert float(counts4["is_norm/0"][1]) > 0  # the pre-pass ran and saw accepted tokens
    assert 0 < float(sums4["corr/env/e0/rejected"]) + float(sums4["corr/env/e1/rejected"])
    for m in (1,):
        loss, grads, sums, counts = results[m]
        np.testing.assert_allclose(counts["is_norm/0"], counts4["is_norm/0"], rtol=1e-5)
        np.testing.assert_allclose(loss, loss4, rtol=1e-5, atol=1e-6)
        for k in sums4:
            np.testing.assert_allclose(sums[k], sums4[k], rtol=1e-5, atol=1e-5, err_msg=k)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads4), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _run_config():
    from primejax.config import default_config, env

    cfg = default_config()
    cfg.model.path = "unused"
    cfg.orchestrator.envs.b_env = env("reverse-text", seed=1)
    cfg.orchestrator.envs.a_env = env("reverse-text", seed=2)
    cfg.orchestrator.envs.a_env.algo.type = "grpo"
    cfg.orchestrator.envs.a_env.algo.correction.objective = "gspo"
    cfg.orchestrator.algo.correction.is_weight.level = "token"
    return cfg


def test_each_env_gets_its_algorithm_blocks_correction():
    from primejax.config import typed

    cfg = typed(_run_config())
    table = CorrectionTable.from_orchestrator(cfg.orchestrator)
    names = table.env_names
    assert names == tuple(sorted(cfg.orchestrator.envs))
    by_env = {n: table.kinds[k] for n, k in zip(names, table.env_kind, strict=True)}
    assert by_env["a_env"].objective == "gspo" and by_env["a_env"].is_weight.level == "none"
    assert by_env["b_env"].is_weight.level == "token"  # inherits orchestrator.algo whole
    assert table.staleness_bins == cfg.orchestrator.async_level + 2


def test_correction_blocks_saved_before_the_papers_defaults_keep_their_behaviour():
    """A saved block without `cispo.mask` (before cispo dropped DPPO's masks, gspo averaged per sequence and
    reject 'sequence' became the sum) loads with the settings that reproduce it; a current one is unchanged."""
    import json

    from primejax.config import from_json, to_json, typed

    cfg = _run_config()
    cfg.orchestrator.envs.a_env.algo.correction.reject.level = "sequence"
    cfg.orchestrator.algo.correction.reject.level = "sequence"
    current = to_json(cfg)
    assert typed(from_json(current)).orchestrator.envs["a_env"].algo.correction.reject.level == "sequence"
    tree = json.loads(current)
    blocks = [
        tree["orchestrator"]["algo"]["correction"],
        tree["orchestrator"]["envs"]["a_env"]["algo"]["correction"],
    ]
    for block in blocks:
        del block["cispo"]["mask"], block["gspo"]["norm"]
    old = typed(from_json(json.dumps(tree))).orchestrator
    for corr in (old.algo.correction, old.envs["a_env"].algo.correction):
        assert (corr.reject.level, corr.cispo.mask, corr.gspo.norm) == ("geometric", "dppo", "token")


@pytest.mark.parametrize(
    "edit, key",
    [
        (
            lambda c: c.orchestrator.envs.a_env.algo.correction.icepop.update(enabled=True),
            "orchestrator.envs.a_env.algo.correction.icepop.enabled",
        ),
        (
            lambda c: c.trainer.loss.update(type="custom", import_path="m.f"),
            "orchestrator.envs.a_env.algo.correction",
        ),
        (
            lambda c: (
                c.orchestrator.envs.a_env.algo.update(type="opd"),
                c.orchestrator.envs.a_env.algo.teacher.update(base_url=("http://h:1/v1",)),
            ),
            "orchestrator.envs.a_env.algo.correction",
        ),
    ],
)
def test_incompatible_run_settings_are_rejected_at_start_up(edit, key):
    from primejax.config import typed

    cfg = _run_config()
    edit(cfg)
    with pytest.raises(ConfigError) as e:
        typed(cfg)
    assert e.value.key == key and "\n" not in str(e.value)


def test_batch_carries_env_ids_and_staleness(tmp_path):
    from primejax.contracts.batch import (
        BatchFormatError,
        TrainingSample,
        pack_samples,
        read_batch,
        write_batch,
    )

    samples = [
        TrainingSample(
            [1, 2, 3, 4],
            [False, True, True, True],
            [0.0, -1.0, -1.0, -1.0],
            advantages=[1.0] * 4,
            policy_version=v,
            env_index=e,
        )
        for v, e in ((4, 0), (2, 1), (5, 1))
    ]
    (batch,) = pack_samples(samples, seq_len=16, step=6, envs=("a", "b"))
    assert batch.meta["envs"] == ["a", "b"]
    for seg, (v, e) in enumerate(((4, 0), (2, 1), (5, 1)), start=1):
        assert set(batch.env_ids[batch.segment_ids == seg]) == {e}
        assert set(batch.staleness[batch.segment_ids == seg]) == {6 - 1 - v}
    back = read_batch(write_batch(tmp_path, 0, batch))
    np.testing.assert_array_equal(back.env_ids, batch.env_ids)
    np.testing.assert_array_equal(back.staleness, batch.staleness)
    batch.env_ids[0, 1] = 2  # no third env
    with pytest.raises(BatchFormatError, match="env_ids"):
        write_batch(tmp_path, 1, batch)
