"""LoRA in the model (models/lora.py): the adapted forward pass equals the forward pass of the merged weights
(W + s·A·B) for a dense Qwen3 and a Qwen3-MoE with every expert, the router and the attention adapted; the
adapters are fp32 and shaped like PEFT's; the `model.lora` section rejects what is not implemented."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from primejax.models import lora, lora_io
from primejax.models.config import ModelConfig
from primejax.models.settings import ModelSettings
from primejax.models.transformer import Transformer, init_model
from primejax.utils.sections import ConfigError

MOE = dict(model_type="qwen3_moe", num_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           mlp_only_layers=(0,))  # fmt: skip
ALL_TARGETS = lora.DEFAULT_TARGETS + ("router",)


def _cfg(family: str) -> ModelConfig:
    """A tiny fp32 Qwen3 (or Qwen3-MoE: one dense layer, two sparse) with rank-4 adapters on every target."""
    fields = dict(
        model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=16, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
        tie_word_embeddings=False, qk_norm=True, attention_bias=False, max_position_embeddings=256,
        param_dtype="float32", compute_dtype="float32", attention_impl="xla",
        lora_rank=4, lora_alpha=8.0, lora_targets=ALL_TARGETS,
    )  # fmt: skip
    return ModelConfig(**{**fields, **(MOE if family == "moe" else {})})


def _randomize_b(params: dict, seed: int = 1) -> dict:
    """Fresh adapters have B = 0 (no effect): give every B random values so the test sees them."""
    key = jax.random.key(seed)
    layers = {
        k: 0.3 * jax.random.normal(jax.random.fold_in(key, i), v.shape) if k.endswith("_lora_b") else v
        for i, (k, v) in enumerate(sorted(params["layers"].items()))
    }
    return {**params, "layers": layers}


def _inputs():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 12)), jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(7), np.arange(5)])[None].repeat(2, 0), jnp.int32)
    segments = jnp.asarray(np.array([1] * 7 + [2] * 5)[None].repeat(2, 0), jnp.int32)
    return tokens, positions, segments


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_lora_forward_equals_merged_weights_forward(family):
    cfg = _cfg(family)
    model = init_model(cfg, None, seed=0)
    graphdef = nnx.graphdef(model)
    params = _randomize_b(nnx.to_pure_dict(nnx.state(model)))
    adapters, frozen = lora.split_adapters(params)
    names = set(adapters["layers"])
    wanted = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    if family == "moe":
        wanted |= {"experts_gate_up", "experts_down", "router"}
    assert names == {w + s for w in wanted for s in ("_lora_a", "_lora_b")}
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adapters))
    assert not any(lora.is_adapter(k) for k in frozen["layers"])
    args = _inputs()

    @jax.jit
    def adapted(p):
        return nnx.merge(graphdef, p).logits(*args)

    @jax.jit
    def merged(p):
        return lora_io.merged_model(p, cfg).logits(*args)

    # the same weights with the adapters' B zeroed, through the same compiled forward (no third compile)
    zero_b = {k: jnp.zeros_like(v) if k.endswith("_lora_b") else v for k, v in params["layers"].items()}
    y, y_merged = (np.asarray(f(params)) for f in (adapted, merged))
    y_base = np.asarray(adapted({**params, "layers": zero_b}))
    np.testing.assert_allclose(y, y_merged, atol=1e-5, rtol=0)
    assert np.abs(y - y_base).max() > 1e-2  # the adapters matter: the comparison above is not vacuous


def test_adapter_shapes_init_and_peft_fan_in():
    """A: U(+-1/sqrt(fan_in)) with fan_in the adapted weight's input width; B zero; shapes from the weight."""
    cfg = _cfg("moe")
    layers = init_model(cfg, None, seed=0).layers
    d, h, dh, e, i, r = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.head_dim,
        cfg.num_experts,
        cfg.moe_intermediate_size,
        4,
    )
    expect = {
        "q_proj_lora_a": (3, d, r), "q_proj_lora_b": (3, r, h, dh), "o_proj_lora_a": (3, h, dh, r),
        "o_proj_lora_b": (3, r, d), "gate_proj_lora_a": (1, d, r), "down_proj_lora_a": (1, 64, r),
        "experts_gate_up_lora_a": (2, e, d, 2, r), "experts_gate_up_lora_b": (2, e, 2, r, i),
        "experts_down_lora_a": (2, e, i, r), "experts_down_lora_b": (2, e, r, d), "router_lora_b": (2, r, e),
    }  # fmt: skip
    for name, shape in expect.items():
        assert getattr(layers, name).shape == shape, name
    fan_in = {"q_proj": d, "o_proj": h * dh, "experts_down": i, "experts_gate_up": d}
    for w, n in fan_in.items():
        a = np.asarray(getattr(layers, w + "_lora_a")[...])
        assert np.abs(a).max() <= 1 / np.sqrt(n) and np.abs(a).max() > 0.8 / np.sqrt(n), w
        assert not np.asarray(getattr(layers, w + "_lora_b")[...]).any()


def test_lora_section_rejects_what_is_not_implemented():
    with pytest.raises(ConfigError, match="dropout: LoRA dropout is not implemented"):
        lora.LoraConfig(rank=8, dropout=0.1)
    with pytest.raises(ConfigError, match="target_modules"):
        lora.LoraConfig(rank=8, target_modules=("q_proj", "lm_head"))
    with pytest.raises(ConfigError, match="rank"):
        lora.LoraConfig(rank=-1)
    assert ModelSettings().overrides().get("lora_rank") is None  # off by default: full fine-tuning
    on = ModelSettings(lora=lora.LoraConfig(rank=8, alpha=32.0))
    assert on.overrides()["lora_rank"] == 8 and on.overrides()["lora_targets"] == lora.DEFAULT_TARGETS
    assert "router" not in lora.DEFAULT_TARGETS
    dense_router = dataclasses.replace(_cfg("dense"), lora_targets=("router",))
    with pytest.raises(ValueError, match=r"target_modules \['router'\] match no weight of this qwen3 model"):
        nnx.eval_shape(lambda: Transformer(dense_router, rngs=nnx.Rngs(0)))
