"""The jitted train step: micro-batch invariance, packing == per-sample, fp64 gradients, learning signal."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from primejax.contracts.batch import TrainingSample, pack_samples
from primejax.models.sharding import make_mesh
from primejax.models.transformer import init_model
from primejax.trainer import optim
from primejax.trainer.engine import jit_train_step
from primejax.trainer.losses import LossConfig
from primejax.trainer.step import (
    device_batch,
    init_state,
    make_grad_fn,
    make_train_step,
    target_logprobs,
    to_micro_batches,
)


@pytest.fixture(scope="module")
def model(tiny_cfg):
    return init_model(tiny_cfg, None, seed=0)


def test_micro_batch_split_gives_same_loss_and_grads(model, make_samples):
    """4 rows as 1x4, 2x2 and 4x1 micro-batches: identical loss, metrics and gradients (fp32, 1e-5)."""
    (batch,) = pack_samples(make_samples(0, 8, max_len=24), seq_len=48, pad_rows_to_multiple=4)
    assert batch.rows == 4
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    fn = jax.jit(make_grad_fn(graphdef, LossConfig(kl_tau=0.1), chunk_size=16))
    results = {m: fn(params, to_micro_batches(batch, m)) for m in (4, 2, 1)}
    loss4, grads4, sums4, counts4 = results[4]
    assert float(counts4["rl"]) > 0 and float(counts4["ce"]) > 0 and float(counts4["ref_kl"]) > 0
    for m in (2, 1):
        loss, grads, sums, _ = results[m]
        np.testing.assert_allclose(loss, loss4, rtol=1e-5, atol=1e-6)
        for k in sums4:
            np.testing.assert_allclose(sums[k], sums4[k], rtol=1e-5, atol=1e-5, err_msg=k)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads4), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_packed_rows_equal_per_sample(model, make_samples):
    """Logits and trainer logprobs of a packed row equal those of each sample run alone (no cross-attention)."""
    samples = make_samples(1, 6, min_len=5, max_len=14)
    (batch,) = pack_samples(samples, seq_len=32)
    assert batch.rows < len(samples)  # really packed

    @jax.jit
    def run(arrays):
        logits = model.logits(arrays["tokens"], arrays["positions"], arrays["segment_ids"])
        return logits, target_logprobs(model, arrays, chunk_size=8)

    packed_logits, packed_lp = run({k: jnp.asarray(v) for k, v in batch.arrays().items()})
    seen = 0
    for r in range(batch.rows):
        for seg in range(1, int(batch.segment_ids[r].max()) + 1):
            sel = np.flatnonzero(batch.segment_ids[r] == seg)
            toks = batch.tokens[r, sel]
            alone = TrainingSample(
                list(toks),
                [False] * len(toks),
                [0.0] * len(toks),
                temperature=float(batch.temperatures[r, sel[0]]),
            )
            (single,) = pack_samples([alone], seq_len=16)  # one padded shape: one compilation
            logits, lp = run({k: jnp.asarray(v) for k, v in single.arrays().items()})
            n = len(sel)
            np.testing.assert_allclose(packed_logits[r, sel], logits[0, :n], atol=2e-5)
            np.testing.assert_allclose(packed_lp[r, sel], lp[0, :n], atol=2e-5)
            seen += 1
    assert seen == len(samples)


_FD_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.test_util import check_grads
    from primejax.trainer.logprobs import token_logprobs
    from primejax.trainer.losses import LossConfig, global_counts, make_loss_fn

    assert jnp.zeros(()).dtype == jnp.float64
    rng = np.random.default_rng(0)
    B, T, D, V = 2, 12, 8, 16
    emb = jnp.asarray(rng.normal(size=(V, D)) * 0.5)
    head = jnp.asarray(rng.normal(size=(D, V)) * 0.5)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)))
    mb = {
        "loss_mask": jnp.asarray(rng.random((B, T)) < 0.8),
        "inference_logprobs": jnp.asarray(np.log(rng.uniform(0.02, 0.3, (B, T)))),
        "advantages": jnp.asarray(rng.normal(size=(B, T))),
        "ref_logprobs": jnp.asarray(np.log(rng.uniform(0.02, 0.3, (B, T)))),
        "rl_weights": jnp.ones((B, T)), "ce_weights": jnp.asarray(rng.choice([0.0, 0.5], (B, T))),
        "ref_kl_weights": jnp.zeros((B, T)),  # sg() in ref_kl is not a derivative: FD cannot check it
        "segment_ids": jnp.ones((B, T), jnp.int32),
    }
    temps = jnp.asarray(rng.choice([0.7, 1.0, 1.3], (B, T)))
    counts = global_counts(mb)
    loss_fn = make_loss_fn(LossConfig(kl_tau=0.1, is_clip=1e9))

    def loss(emb, head):
        # a tiny causal "model": hidden = tanh(embedding of the previous token) -> LM head
        h = jnp.tanh(emb[tokens])
        lp, ent = token_logprobs(h, head, jnp.roll(tokens, -1, axis=1), temps, chunk_size=5)
        return loss_fn(lp, ent, mb, counts)[0]

    check_grads(loss, (emb, head), order=1, modes=["rev"], eps=1e-6, atol=1e-7, rtol=1e-6)
    print("ok", float(loss(emb, head)))
    """
)


def test_rl_loss_gradients_match_finite_differences_fp64():
    out = subprocess.run(
        [sys.executable, "-c", _FD_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={"JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


@pytest.fixture(scope="module")
def rl_setup(tiny_cfg):
    """One jitted rl train step and logprob function, shared (one compilation each) by the tests below."""
    graphdef = nnx.graphdef(init_model(tiny_cfg, None, seed=1))
    sched = optim.make_schedule(3e-3)
    opt = optim.make_optimizer(
        {"lr": 3e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "max_norm": 1.0}, sched
    )
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    like = init_state(init_model(tiny_cfg, None, seed=1), opt, mesh=mesh)
    step = jit_train_step(make_train_step(graphdef, opt, sched, LossConfig()), like, mesh)
    logprobs = jax.jit(lambda params, arrays: target_logprobs(nnx.merge(graphdef, params), arrays))
    return graphdef, opt, mesh, step, logprobs


def _contrastive_batch(params, logprobs, adv_sign: float):
    """One prompt, two continuations; the first gets advantage +adv_sign, the second -adv_sign. On-policy lq."""
    prompt = [5, 9, 13, 2]
    good, bad = [7, 7, 3, 1], [8, 4, 11, 6]
    samples = []
    for cont, a in ((good, adv_sign), (bad, -adv_sign)):
        toks = prompt + cont
        mask = [False] * len(prompt) + [True] * len(cont)
        samples.append(TrainingSample(toks, mask, [0.0] * len(toks), advantages=[a] * len(toks)))
    (batch,) = pack_samples(samples, seq_len=16)
    lq = np.asarray(logprobs(params, batch.arrays()))
    batch.inference_logprobs = np.where(batch.loss_mask, lq, 0.0).astype(np.float32)
    return batch


def _continuation_logprob(params, logprobs, batch, seg):
    lp = np.asarray(logprobs(params, batch.arrays()))
    return float(lp[(batch.segment_ids == seg) & batch.loss_mask].sum())


def test_rl_training_raises_the_positive_advantage_continuation(tiny_cfg, rl_setup):
    graphdef, opt, mesh, step, logprobs = rl_setup
    state = init_state(init_model(tiny_cfg, None, seed=1), opt, mesh=mesh)
    p0 = jax.tree.map(np.asarray, state.params)
    batch = _contrastive_batch(p0, logprobs, 1.0)
    # equal lengths keep input order: segment 1 is the good continuation
    good_before, bad_before = (_continuation_logprob(p0, logprobs, batch, s) for s in (1, 2))
    with jax.set_mesh(mesh):
        for _ in range(10):
            state, metrics = step(state, device_batch(to_micro_batches(batch, 1), mesh))
    assert int(metrics["nonfinite"]) == 0 and int(state.step) == 10
    good_after, bad_after = (_continuation_logprob(state.params, logprobs, batch, s) for s in (1, 2))
    assert good_after > good_before + 1.0
    assert bad_after < bad_before - 1.0


def test_nonfinite_step_is_skipped(tiny_cfg, rl_setup):
    graphdef, opt, mesh, step, logprobs = rl_setup
    state = init_state(init_model(tiny_cfg, None, seed=2), opt, mesh=mesh)
    before = jax.tree.map(np.asarray, state.params)
    batch = _contrastive_batch(before, logprobs, 1.0)
    batch.advantages[batch.loss_mask] = np.inf  # the file contract forbids this; the guard still holds
    with jax.set_mesh(mesh):
        state, metrics = step(state, device_batch(to_micro_batches(batch, 1), mesh))
    assert int(metrics["nonfinite"]) == 1 and int(state.step) == 0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): two more compiled steps
def test_bf16_step_matches_fp32_on_cpu(tiny_cfg):
    """The default compute dtype (bf16) trains on CPU too, and tracks the fp32 step to bf16 precision.

    XLA:CPU has no bf16 x bf16 -> f32 dot inside fusions; `models.precision.accumulating_einsum` upcasts there
    (before it, this whole step failed with "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32").
    """
    import dataclasses

    import optax

    from primejax.trainer.loop import fake_batch

    batch = fake_batch(np.random.default_rng(0), 1, 128, 512)
    mesh = make_mesh()
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = dataclasses.replace(
            tiny_cfg,
            compute_dtype=dtype,
            vocab_size=512,
            hidden_size=64,
            head_dim=32,
            intermediate_size=128,
            num_layers=1,
            tie_word_embeddings=True,
        )
        opt = optim.make_optimizer(
            dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, max_norm=1.0),
            optax.constant_schedule(1e-3),
        )
        with jax.set_mesh(mesh):
            state = init_state(init_model(cfg, mesh, seed=0), opt, mesh=mesh)
            graphdef = nnx.graphdef(init_model(cfg, mesh, seed=0))
            step = jit_train_step(
                make_train_step(
                    graphdef,
                    opt,
                    optax.constant_schedule(1e-3),
                    LossConfig(),
                    chunk_size=2048,
                    max_segments=1,
                ),
                state,
                mesh,
            )
            _, metrics = step(state, device_batch(to_micro_batches(batch, 1), mesh))
        out[dtype] = {k: float(metrics[k]) for k in ("loss", "grad_norm", "nonfinite")}
    assert out["bfloat16"]["nonfinite"] == 0
    np.testing.assert_allclose(out["bfloat16"]["loss"], out["float32"]["loss"], rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(out["bfloat16"]["grad_norm"], out["float32"]["grad_norm"], rtol=5e-2)
