"""HF -> primejax -> HF safetensors round trips, exported directories loading in transformers, and errors."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from primejax.models.hf_io import export_safetensors, load_model


def _read_dir(path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="numpy") as h:
            for name in h.keys():
                out[name] = h.get_tensor(name)
    return out


def _torch_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


TOKENS = np.random.default_rng(0).integers(0, 512, size=(2, 24))


@pytest.mark.parametrize(
    "variant",
    [
        "qwen3_tied",
        "qwen3_untied",
        "llama_rope3",
        "qwen2_bias",
        "qwen3_moe_e8k2_tied",
        "qwen3_moe_e6k3_step2",
        "glm4_moe_g4_dense1",
        "glm4_moe_tied_qknorm",
        "deepseek_v3_qlora",
        "deepseek_v3_noqlora_tied",
        "qwen3_5_hybrid",
        "qwen3_5_alt_tied",
        "qwen3_5_moe_hybrid",
        "qwen3_5_moe_alt_tied",
    ],
)
def test_round_trip_is_bit_identical_and_loads_in_transformers(variant, hf_model_dir, tmp_path):
    src, torch_model = hf_model_dir(variant)
    model, cfg = load_model(src, param_dtype="float32")
    # A small shard limit forces several files, exercising the index.
    stats = export_safetensors(model, cfg, tmp_path, dtype=None, src_dir=src, max_shard_bytes=200_000)
    assert stats["files"] > 1 and stats["bytes"] > 0 and stats["seconds"] >= 0

    before, after = _read_dir(src), _read_dir(tmp_path)
    assert sorted(after) == sorted(before)
    for name, ref in before.items():
        got = after[name]
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert np.array_equal(got.view(np.uint8), ref.view(np.uint8)), f"{name} differs bitwise"

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(before)
    assert all((tmp_path / f).is_file() for f in index["weight_map"].values())
    assert (tmp_path / "generation_config.json").is_file()

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    err = float(np.abs(_torch_logits(reloaded, TOKENS) - _torch_logits(torch_model, TOKENS)).max())
    assert err == 0.0, f"{variant}: transformers logits from the exported dir differ by {err:.3e}"


def test_default_export_is_bf16_and_loads_in_transformers(hf_model_dir, tmp_path):
    src, torch_model = hf_model_dir("qwen3_tied")
    model, cfg = load_model(src, param_dtype="float32")
    export_safetensors(model, cfg, tmp_path, src_dir=src)
    tensors = _read_dir(tmp_path)
    assert {t.dtype for t in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["dtype"] == hf_cfg["torch_dtype"] == "bfloat16"
    assert hf_cfg["architectures"] == ["Qwen3ForCausalLM"] and hf_cfg["tie_word_embeddings"] is True
    # Values are the fp32 weights rounded to bf16.
    ref = _read_dir(src)
    for name, t in tensors.items():
        np.testing.assert_array_equal(t, ref[name].astype(ml_dtypes.bfloat16), err_msg=name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.dtype == torch.bfloat16
    err = float(np.abs(_torch_logits(reloaded.float(), TOKENS) - _torch_logits(torch_model, TOKENS)).max())
    assert err < 0.05, f"bf16 export logits differ from fp32 by {err:.3e}"


def test_loads_sharded_hf_checkpoint(hf_model_dir, tmp_path):
    src, torch_model = hf_model_dir("qwen3_untied")
    torch_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a, _ = load_model(src, param_dtype="float32")
    b, _ = load_model(tmp_path, param_dtype="float32")
    for (na, va), (nb, vb) in zip(_named(a), _named(b), strict=True):
        assert na == nb and np.array_equal(va, vb), na


def _named(model):
    from primejax.models.hf_io import param_variables

    return [(k, np.asarray(v[...])) for k, v in param_variables(model).items()]


def test_missing_config_or_weights_name_the_directory(hf_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_model(tmp_path)
    src, _ = hf_model_dir("qwen3_tied")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors.*" + str(tmp_path)):
        load_model(tmp_path)


def test_bf16_params_load_and_run(hf_model_dir):
    src, _ = hf_model_dir("llama_gqa")
    model, cfg = load_model(src, param_dtype="bfloat16", compute_dtype="bfloat16")
    assert model.layers.q_proj[...].dtype == np.dtype(ml_dtypes.bfloat16)
    hidden = model(
        TOKENS.astype(np.int32), np.tile(np.arange(24, dtype=np.int32), (2, 1)), np.ones((2, 24), np.int32)
    )
    assert hidden.dtype == np.dtype(ml_dtypes.bfloat16) and hidden.shape == (2, 24, cfg.hidden_size)
    assert np.isfinite(np.asarray(hidden, np.float32)).all()


def test_moe_export_is_per_expert_and_fused_checkpoints_load(hf_model_dir, tmp_path):
    """Our MoE export writes one tensor per expert (the Hub layout every vLLM loads); transformers' fused
    on-disk form (save_original_format=False) loads to the same parameters."""
    src, torch_model = hf_model_dir("qwen3_moe_e4k1_dense0")
    model, cfg = load_model(src, param_dtype="float32")
    export_safetensors(model, cfg, tmp_path / "ours", dtype=None)
    names = set(_read_dir(tmp_path / "ours"))
    assert (
        "model.layers.1.mlp.experts.3.down_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    )
    assert "model.layers.0.mlp.gate_proj.weight" in names  # mlp_only_layers=[0] stays dense
    assert not any("gate_up_proj" in n for n in names)
    hf_cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert hf_cfg["num_experts"] == 4 and hf_cfg["mlp_only_layers"] == [0]

    torch_model.save_pretrained(tmp_path / "fused", save_original_format=False)
    assert any("gate_up_proj" in n for n in _read_dir(tmp_path / "fused"))
    fused, _ = load_model(tmp_path / "fused", param_dtype="float32")
    for name, var in vars(model.layers).items():
        if hasattr(var, "shape"):
            np.testing.assert_array_equal(
                np.asarray(getattr(fused.layers, name)[...]), np.asarray(var[...]), err_msg=name
            )


def test_glm4_moe_bf16_export_keeps_the_correction_bias_fp32(hf_model_dir, tmp_path):
    """A bf16 export writes GLM-4.5's e_score_correction_bias in fp32 (as transformers and vLLM keep it: it
    decides near-ties between experts), every other tensor in bf16; the config round-trips the family's keys."""
    src, _ = hf_model_dir("glm4_moe_g4_dense1")
    model, cfg = load_model(src, param_dtype="bfloat16")
    assert model.layers.router_bias[...].dtype == np.float32  # never rounded at load either
    export_safetensors(model, cfg, tmp_path, src_dir=src)
    tensors, ref = _read_dir(tmp_path), _read_dir(src)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            np.testing.assert_array_equal(t, ref[name], err_msg=name)
        else:
            assert t.dtype == np.dtype(ml_dtypes.bfloat16), name
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in tensors
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    src_cfg = json.loads((src / "config.json").read_text())
    for key in (
        "n_routed_experts",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "routed_scaling_factor",
        "n_shared_experts",
        "partial_rotary_factor",
        "use_qk_norm",
        "attention_bias",
        "norm_topk_prob",
        "num_nextn_predict_layers",
    ):
        assert hf_cfg[key] == src_cfg[key], key
    assert hf_cfg["architectures"] == ["Glm4MoeForCausalLM"]
