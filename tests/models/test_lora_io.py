"""LoRA export (models/lora_io.py): the PEFT adapter directory carries PEFT's names and layouts and reads back
bit-identically (dense and per-expert adapters), and `merge_peft` (`tools/convert_checkpoint.py merge-lora`)
writes merged HF weights whose forward pass, loaded through the ordinary HF load path, equals the adapted model's."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from primejax.models import lora, lora_io
from primejax.models.config import ModelConfig
from primejax.models.hf_io import load_model
from primejax.models.transformer import init_model

R = 4


def _random_b(params: dict) -> dict:
    key = jax.random.key(7)
    layers = {
        k: 0.05 * jax.random.normal(jax.random.fold_in(key, i), v.shape) if k.endswith("_lora_b") else v
        for i, (k, v) in enumerate(sorted(params["layers"].items()))
    }
    return {**params, "layers": layers}


def test_peft_directory_round_trips_dense_and_expert_adapters(tmp_path):
    cfg = ModelConfig(
        model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=16, rope_theta=1e4, rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False,
        qk_norm=True, attention_bias=False, max_position_embeddings=64, param_dtype="float32", num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(0,), lora_rank=R, lora_alpha=8.0,
        lora_targets=("q_proj", "o_proj", "gate_proj", "down_proj", "experts", "router"),
    )  # fmt: skip
    adapters, _ = lora.split_adapters(_random_b(nnx.to_pure_dict(nnx.state(init_model(cfg, None, seed=0)))))
    out = lora_io.export_peft(adapters, cfg, tmp_path / "adapter", base_model="tiny")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == R and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert config["target_modules"] == ["down_proj", "gate", "gate_proj", "o_proj", "q_proj", "up_proj"]
    tensors = load_file(str(out / "adapter_model.safetensors"))
    p = "base_model.model.model.layers"
    expect = {
        f"{p}.0.self_attn.q_proj.lora_A.weight": (R, 32), f"{p}.1.self_attn.q_proj.lora_B.weight": (32, R),
        f"{p}.0.self_attn.o_proj.lora_A.weight": (R, 32), f"{p}.0.mlp.gate_proj.lora_B.weight": (64, R),
        f"{p}.0.mlp.down_proj.lora_A.weight": (R, 64), f"{p}.1.mlp.gate.lora_B.weight": (4, R),
        f"{p}.1.mlp.experts.3.gate_proj.lora_A.weight": (R, 32), f"{p}.1.mlp.experts.3.up_proj.lora_B.weight": (16, R),
        f"{p}.1.mlp.experts.0.down_proj.lora_A.weight": (R, 16), f"{p}.1.mlp.experts.0.down_proj.lora_B.weight": (32, R),
    }  # fmt: skip
    for name, shape in expect.items():
        assert tensors[name].shape == shape and tensors[name].dtype == np.float32, name
    assert not any(
        ".0.mlp.experts." in k or ".1.mlp.gate_proj" in k for k in tensors
    )  # layer 0 dense, 1 sparse
    # PEFT's lora_B of up_proj for expert 3 is that expert's up half of our stacked B, transposed
    np.testing.assert_array_equal(
        tensors[f"{p}.1.mlp.experts.3.up_proj.lora_B.weight"],
        np.asarray(adapters["layers"]["experts_gate_up_lora_b"])[0, 3, 1].T,
    )
    assert lora_io.adapter_settings(out) == {
        "lora_rank": R, "lora_alpha": 8.0, "lora_targets": ("q_proj", "o_proj", "gate_proj", "down_proj", "router", "experts")
    }  # fmt: skip
    back = lora_io.read_peft(out, cfg)
    assert set(back["layers"]) == set(adapters["layers"])
    for k, v in adapters["layers"].items():
        np.testing.assert_array_equal(back["layers"][k], np.asarray(v), err_msg=k)


def test_merge_peft_gives_the_adapted_models_forward(tiny_untied_model_dir, tmp_path):
    model, cfg = load_model(
        tiny_untied_model_dir, param_dtype="float32", compute_dtype="float32", lora_rank=R, lora_alpha=16.0,
        lora_targets=lora.DEFAULT_TARGETS,
    )  # fmt: skip
    lora.fill_adapters(model, seed=0)
    params = _random_b(nnx.to_pure_dict(nnx.state(model)))
    adapters, _ = lora.split_adapters(params)
    lora_io.export_peft(adapters, cfg, tmp_path / "adapter")
    lora_io.merge_peft(tiny_untied_model_dir, tmp_path / "adapter", tmp_path / "merged", dtype="float32")
    merged, merged_cfg = load_model(tmp_path / "merged", param_dtype="float32", compute_dtype="float32")
    assert merged_cfg.lora_rank == 0 and merged_cfg.hidden_size == cfg.hidden_size
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    positions, segments = jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1)), jnp.ones((2, 16), jnp.int32)
    graphdef = nnx.graphdef(model)
    adapted = jax.jit(lambda p: nnx.merge(graphdef, p).logits(tokens, positions, segments))(params)
    base = jax.jit(lambda m: m.logits(tokens, positions, segments))(merged)
    np.testing.assert_allclose(np.asarray(base), np.asarray(adapted), atol=1e-5, rtol=0)
    # a directory that is not an adapter: refused (the tool prints it as one line, exit code 1), nothing written
    with pytest.raises(lora_io.AdapterError):
        lora_io.merge_peft(tiny_untied_model_dir, tmp_path, tmp_path / "x")
    assert not (tmp_path / "x").exists()
