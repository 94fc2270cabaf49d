"""Routing replay in the trainer: a batch's routed experts (orchestrator -> file -> trainer) reach the model as
`replay` on the right positions, giving exactly the logprobs of the model routed by hand to those experts, and
the router still gets a gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from primejax.contracts.batch import TrainingSample, pack_samples, read_batch, write_batch
from primejax.models.config import ModelConfig
from primejax.models.transformer import init_model
from primejax.trainer.step import _micro_loss_fn, to_micro_batches

E, K = 4, 2


def _cfg() -> ModelConfig:
    # layer 0 dense: the replayed experts are per MoE layer (2 of 3 layers)
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
        num_kv_heads=1, head_dim=16, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
        tie_word_embeddings=False, qk_norm=True, attention_bias=False, max_position_embeddings=256,
        param_dtype="float32", compute_dtype="float32", attention_impl="xla",
        num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16, mlp_only_layers=(0,),
    )  # fmt: skip


def _samples(cfg, seed=0):
    """Prompt + completion samples; each completion token records random distinct experts per MoE layer."""
    rng = np.random.default_rng(seed)
    ls = len(cfg.sparse_layers())
    out = []
    for p, c in ((5, 7), (3, 9), (6, 4)):
        n = p + c
        experts = np.zeros((n, ls, K), np.uint8)
        for t in range(p, n):
            for layer in range(ls):
                experts[t, layer] = rng.permutation(E)[:K]
        out.append(
            TrainingSample(
                token_ids=rng.integers(0, cfg.vocab_size, n).tolist(),
                loss_mask=[False] * p + [True] * c,
                inference_logprobs=[0.0] * p + [-1.0] * c,
                advantages=[1.0] * n,
                routed_experts=experts,
                routed_mask=[False] * p + [True] * c,
            )
        )
    return out


PAD = 16


@nnx.jit
def _forward(model, tokens, pos, seg, idx, mask):
    h, _ = model.forward_with_aux(tokens, pos, seg, replay=(idx, mask))
    return jax.nn.log_softmax(h[0] @ model.lm_head_weight(), axis=-1)  # position t predicts token t + 1


def _reference_logprobs(model, cfg, s: TrainingSample, replay: bool) -> np.ndarray:
    """Model-side: one sample alone (padded), its completion positions routed by hand (row t -> position t - 1)."""
    n = len(s)
    tokens = np.zeros((1, PAD), np.int32)
    tokens[0, :n] = s.token_ids
    pos = np.arange(PAD, dtype=np.int32)[None]
    seg = (np.arange(PAD) < n).astype(np.int32)[None]
    idx = np.zeros((1, PAD, len(cfg.sparse_layers()), K), np.int32)
    mask = np.zeros((1, PAD), bool)
    if replay:
        marked = np.flatnonzero(s.routed_mask)
        idx[0, marked - 1] = s.routed_experts[marked]
        mask[0, marked - 1] = True
    lp = np.asarray(_forward(model, tokens, pos, seg, idx, mask))
    return np.asarray([lp[t - 1, s.token_ids[t]] for t in range(1, n)])


def _trainer_path(model, arrays):
    """The trainer's micro-batch loss function, with a loss that hands back its per-position logprobs."""
    graphdef, params = nnx.split(model)
    capture = _micro_loss_fn(
        graphdef, lambda lp, ent, streams, counts: (jnp.sum(lp * streams["loss_mask"]), {"lp": lp}), 16, 0, 0
    )
    return jax.jit(capture), nnx.to_pure_dict(params), {k: jnp.asarray(v[0]) for k, v in arrays.items()}


def test_trainer_replay_equals_model_side_replay_through_a_batch_file(tmp_path):
    cfg = _cfg()
    model = init_model(cfg, None, seed=1)
    samples = _samples(cfg)
    (batch,) = pack_samples(samples, seq_len=32)
    path = write_batch(tmp_path, 0, batch, {"num_experts": E})
    got = read_batch(path, vocab_size=cfg.vocab_size, num_experts=E, routing_shape=(2, K))
    np.testing.assert_array_equal(got.routed_experts, batch.routed_experts)
    np.testing.assert_array_equal(got.routed_mask, batch.routed_mask)
    fn, params, mb = _trainer_path(model, to_micro_batches(got, got.rows))
    lp = np.asarray(fn(params, mb, None)[1]["lp"])
    free_mb = {k: v for k, v in mb.items() if not k.startswith("routed_")}
    lp_free = np.asarray(fn(params, free_mb, None)[1]["lp"])

    changed = 0
    for s in samples:  # find each sample's segment in the packed rows
        for r in range(got.rows):
            for seg in range(1, int(got.segment_ids[r].max()) + 1):
                where = np.flatnonzero(got.segment_ids[r] == seg)
                if got.tokens[r, where].tolist() != s.token_ids:
                    continue
                trainer = lp[r, where[:-1]]  # position t predicts token t + 1 of the sample
                ref = _reference_logprobs(model, cfg, s, replay=True)
                np.testing.assert_allclose(trainer, ref, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(
                    lp_free[r, where[:-1]], _reference_logprobs(model, cfg, s, False), rtol=1e-5, atol=1e-5
                )
                changed += int(np.sum(np.abs(trainer - lp_free[r, where[:-1]]) > 1e-4))
    assert changed > 0, "the recorded experts never changed a logprob: replay did not reach the model"


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): another compile; the default tier: tests/models/test_moe.py
def test_router_gets_gradient_through_replayed_tokens():
    cfg = _cfg()
    model = init_model(cfg, None, seed=2)
    samples = _samples(cfg, seed=3)
    for s in samples:  # every real token after the first is replayed: no token routes freely
        s.routed_mask = [False] + [True] * (len(s) - 1)
        for t in range(1, len(s)):
            s.routed_experts[t] = [[(t + layer) % E, (t + layer + 1) % E] for layer in range(2)]
    (batch,) = pack_samples(samples, seq_len=32)
    fn, params, mb = _trainer_path(model, to_micro_batches(batch, batch.rows))
    g_replay = jax.jit(jax.grad(lambda p, mb: fn(p, mb, None)[0]))(params, mb)["layers"]["router"]
    # every token's experts are fixed, so this gradient comes only through the gathered (renormalized) scores
    assert np.isfinite(np.asarray(g_replay)).all() and float(jnp.abs(g_replay).max()) > 1e-6
