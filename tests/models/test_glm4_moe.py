"""GLM-4.5 MoE pieces: the sigmoid group-limited router against transformers' Glm4MoeTopkRouter, routing
replay through it (recorded experts, router gradient, frozen correction bias), the config read from a real
GLM-4.5-Air config.json, its FLOPs and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from primejax.models import moe
from primejax.models.config import ModelConfig

# zai-org/GLM-4.5-Air config.json (the keys that shape the model)
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "partial_rotary_factor": 0.5,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_qk_norm": False,
    "vocab_size": 151552,
    "eos_token_id": [151329, 151336, 151338],
    "pad_token_id": 151329,
}


def _hf_router(e, k, n_group, topk_group, norm, scale, d=32, seed=0):
    cfg = transformers.Glm4MoeConfig(
        hidden_size=d, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
        norm_topk_prob=norm, routed_scaling_factor=scale,
    )  # fmt: skip
    router = Glm4MoeTopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(0.5 * torch.randn(e, d, generator=g))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(e, generator=g))
    return router


@pytest.mark.parametrize(
    ("e", "k", "n_group", "topk_group", "norm", "scale"),
    [(8, 2, 4, 2, True, 2.5), (16, 4, 4, 1, False, 1.0), (12, 3, 1, 1, True, 1.0), (32, 8, 8, 3, True, 2.5)],
)
def test_sigmoid_group_limited_router_matches_transformers(e, k, n_group, topk_group, norm, scale):
    router = _hf_router(e, k, n_group, topk_group, norm, scale)
    x = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    with torch.no_grad():
        logits, w_ref, i_ref = router(torch.as_tensor(x))
    r = moe.route(
        jnp.asarray(x), jnp.asarray(router.weight.detach().numpy().T), k, norm, scoring="sigmoid",
        bias_e=jnp.asarray(router.e_score_correction_bias.numpy()), n_group=n_group, topk_group=topk_group,
        scale=scale,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(r.logits), logits.numpy(), rtol=1e-6, atol=1e-6)
    # torch's top-k is unsorted: compare each token's (expert -> weight) map
    i_ref, w_ref = i_ref.numpy(), w_ref.numpy()
    ours_i, ours_w = np.asarray(r.topk_idx), np.asarray(r.scores)
    for t in range(x.shape[0]):
        assert sorted(ours_i[t]) == sorted(i_ref[t]), t
        np.testing.assert_allclose(
            ours_w[t][np.argsort(ours_i[t])], w_ref[t][np.argsort(i_ref[t])], rtol=1e-6, atol=1e-7
        )
    if n_group > 1:  # every chosen expert lies in one of the topk_group groups kept
        groups = ours_i // (e // n_group)
        assert max(len(set(g)) for g in groups) <= topk_group
    # the correction bias changes the choice (else this test would not check it) but not the weights' source
    free = moe.route(
        jnp.asarray(x),
        jnp.asarray(router.weight.detach().numpy().T),
        k,
        norm,
        scoring="sigmoid",
        n_group=n_group,
        topk_group=topk_group,
        scale=scale,
    )
    assert not np.array_equal(np.sort(np.asarray(free.topk_idx)), np.sort(ours_i))


def test_sigmoid_replay_uses_recorded_experts_router_gradient_and_frozen_bias():
    rng = np.random.default_rng(2)
    n, d, e, k, scale = 6, 8, 8, 2, 2.5
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, e)), jnp.float32)
    bias = jnp.asarray(0.3 * rng.standard_normal(e), jnp.float32)
    kw = dict(scoring="sigmoid", bias_e=bias, n_group=4, topk_group=2, scale=scale)
    free = moe.route(x, w, k, True, **kw)
    # experts the router would not pick (outside its kept groups, even): the two lowest-scoring
    recorded = jnp.argsort(free.logits, axis=-1)[:, :k].astype(jnp.int32)
    mask = jnp.asarray([True, True, False, True, False, True])
    r = moe.route(x, w, k, True, recorded, mask, **kw)
    m = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(r.topk_idx)[m], np.asarray(recorded)[m])
    np.testing.assert_array_equal(np.asarray(r.topk_idx)[~m], np.asarray(free.topk_idx)[~m])
    s = np.take_along_axis(1 / (1 + np.exp(-np.asarray(free.logits, np.float64))), np.asarray(recorded), -1)
    np.testing.assert_allclose(np.asarray(r.scores)[m], (scale * s / s.sum(-1, keepdims=True))[m], rtol=1e-5)

    def loss(w, bias):
        out = moe.route(x, w, k, False, recorded, jnp.ones(n, bool), **{**kw, "bias_e": bias})
        return jnp.sum(out.scores[:, 0])

    gw, gb = jax.grad(loss, argnums=(0, 1))(w, bias)
    assert float(jnp.abs(gw).max()) > 1e-4
    assert float(jnp.abs(gb).max()) == 0.0  # the correction bias only steers the choice: never trained


def test_glm45_air_config_round_trip_flops_and_params():
    cfg = ModelConfig.from_hf_config(GLM45_AIR)
    assert cfg.sparse_layers() == tuple(range(1, 46)) and cfg.dense_layers() == (0,)
    assert cfg.router_scoring == "sigmoid" and cfg.n_shared_experts == 1 and cfg.rotary_dim == 64
    assert cfg.attention_bias and not cfg.attention_out_bias and not cfg.qk_norm
    hf = cfg.to_hf_config()
    assert hf["num_nextn_predict_layers"] == 1 and hf["eos_token_id"] == [151329, 151336, 151338]
    assert ModelConfig.from_hf_config(hf) == cfg

    d, h, kv, dh = 4096, 96, 8, 128
    attn = d * h * dh + 2 * d * kv * dh + h * dh * d
    dense_mlp = 3 * d * 10944
    sparse = (8 + 1) * 3 * d * 1408 + d * 128  # top-8 routed + 1 shared expert, router
    active = 46 * attn + dense_mlp + 45 * sparse + d * 151552
    assert cfg.num_matmul_params() == active
    assert 12.5e9 < active < 13e9  # GLM-4.5-Air: "12B active"
    # attention term with GLM's own head width (96 x 128 = 12288, three times hidden/heads x heads)
    assert cfg.flops_per_token(16384) == 6 * active + 12 * 46 * h * dh * 16384
    total = cfg.num_params()
    assert 106e9 < total < 111e9  # GLM-4.5-Air: "106B total" (plus its embedding)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"n_group": 3}, "n_group"),
        ({"n_group": 4, "topk_group": 5}, "topk_group"),
        ({"n_group": 128}, "two best"),
        ({"partial_rotary_factor": 1.5}, "rotary_dim"),
    ],
)
def test_glm4_moe_bad_configs_fail_clearly(change, error):
    with pytest.raises(ValueError, match=error):
        ModelConfig.from_hf_config({**GLM45_AIR, **change})


def test_glm4_moe_dense_layers_must_come_first():
    cfg = ModelConfig.from_hf_config(GLM45_AIR, mlp_only_layers=(3,))
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        cfg.to_hf_config()


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): a whole GLM step compile
def test_optimizer_step_leaves_the_correction_bias_unchanged():
    """The bias's gradient is zero (route stops it) and it is not decayed, so an AdamW step with weight decay,
    through the trainer's optimizer, moves every matrix but not the bias (stacked [Ls, E]: rank 2, like a matrix)."""
    from flax import nnx

    from primejax.models.transformer import init_model
    from primejax.trainer.optim import make_optimizer

    cfg = ModelConfig.from_hf_config(
        {**GLM45_AIR, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 16, "vocab_size": 64, "n_group": 2},
        param_dtype="float32", compute_dtype="float32", gmm_impl="xla",
    )  # fmt: skip
    model = init_model(cfg, None, seed=0)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 12)), jnp.int32)
    pos, seg = jnp.arange(12, dtype=jnp.int32)[None], jnp.ones((1, 12), jnp.int32)

    def loss(pure):
        nnx.replace_by_pure_dict(s := jax.tree.map(lambda x: x, state), pure)
        return jnp.mean(nnx.merge(graphdef, s).logits(tokens, pos, seg) ** 2)

    opt = make_optimizer(
        dict(max_norm=1.0, lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1), lambda _: 1e-2
    )
    grads = jax.grad(loss)(params)
    assert float(jnp.abs(grads["layers"]["router_bias"]).max()) == 0.0
    updates, _ = opt.update(grads, opt.init(params), params)
    assert float(jnp.abs(updates["layers"]["router_bias"]).max()) == 0.0
    assert float(jnp.abs(updates["layers"]["router"]).max()) > 0.0
    assert float(jnp.abs(updates["layers"]["shared_gate_proj"]).max()) > 0.0


def test_tiny_glm4_moe_build_matches_its_section_architecture(tmp_path):
    """`model.build_tiny.family=glm4_moe` writes the GLM-4.5 structure its section's `architecture()` describes
    (benchmarks use the latter without building)."""
    import dataclasses

    from primejax.models.tiny import TinyModelConfig

    section = TinyModelConfig(enabled=True, family="glm4_moe", num_experts=8, num_experts_per_tok=2)
    built = ModelConfig.from_model_dir(section.build(tmp_path / "m"))
    described = section.architecture()
    same = ("model_type", "vocab_size", "hidden_size", "num_layers", "head_dim", "tie_word_embeddings", "qk_norm",
            "attention_bias", "attention_out_bias", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "norm_topk_prob", "mlp_only_layers", "router_scoring", "n_group", "topk_group", "routed_scaling_factor",
            "n_shared_experts", "partial_rotary_factor")  # fmt: skip
    for f in same:
        assert getattr(built, f) == getattr(described, f), f
    assert {f.name for f in dataclasses.fields(ModelConfig)} >= set(same)
    with pytest.raises(Exception, match="num_experts"):
        TinyModelConfig(enabled=True, family="glm4_moe", num_experts=6 + 1, num_experts_per_tok=2).check()
