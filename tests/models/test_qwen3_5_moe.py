"""Qwen3.5 MoE (qwen3_5_moe_text): the multimodal checkpoint's language model (fused experts, wrapped names)
loading to transformers' logits and exporting to the text checkpoint bit for bit, routing replay and expert load
through the hybrid stack, the Qwen3.5-35B-A3B shape's accounting, and refusals. Logits parity, packed rows and
the text checkpoint's round trip are test_parity.py's and test_hf_io.py's variants `qwen3_5_moe_*`."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_variants import read_checkpoint_tensors, write_multimodal_checkpoint

from primejax.models.config import ModelConfig
from primejax.models.hf_io import export_safetensors, load_model
from primejax.models.moe import max_violation

TOL = 1e-4


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def test_multimodal_fused_checkpoint_loads_and_exports_the_text_model_bit_exact(hf_model_dir, tmp_path):
    """transformers' fused expert tensors (gate_up_proj [E, 2I, D], down_proj [E, D, I]) under
    `model.language_model.*` in a `qwen3_5_moe` wrapper: loads to transformers' logits, and the export is the
    text-only checkpoint, every tensor bit-identical to the per-expert one transformers writes."""
    src, torch_model = hf_model_dir("qwen3_5_moe_hybrid")
    torch_model.save_pretrained(tmp_path / "fused", save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in read_checkpoint_tensors(tmp_path / "fused")
    (tmp_path / "mm").mkdir()
    write_multimodal_checkpoint(tmp_path / "fused", tmp_path / "mm", "qwen3_5_moe")

    model, cfg = load_model(tmp_path / "mm", param_dtype="float32", compute_dtype="float32")
    assert cfg.model_type == "qwen3_5_moe_text" and cfg.sparse_layers() == (0, 1, 2, 3)
    tokens = np.random.default_rng(3).integers(0, 512, size=(1, 30)).astype(np.int32)
    ours = np.asarray(
        nnx.jit(lambda m, t: m.logits(t, jnp.arange(30, dtype=jnp.int32)[None], jnp.ones_like(t)))(
            model, tokens
        )
    )
    err = float(np.abs(ours - _hf_logits(torch_model, tokens)).max())
    assert err <= TOL, err

    export_safetensors(model, cfg, tmp_path / "out", dtype=None)
    hf_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and hf_cfg["model_type"] == "qwen3_5_moe_text"
    assert hf_cfg["shared_expert_intermediate_size"] == 48 and "intermediate_size" not in hf_cfg
    before, after = read_checkpoint_tensors(src), read_checkpoint_tensors(tmp_path / "out")
    assert sorted(after) == sorted(before)
    assert "model.layers.3.mlp.shared_expert_gate.weight" in after
    for name, ref in before.items():
        assert after[name].dtype == ref.dtype and np.array_equal(
            after[name].view(np.uint8), ref.view(np.uint8)
        ), name


def test_routing_replay_takes_the_recorded_experts_through_the_hybrid_stack(hf_model_dir):
    """Replayed tokens use the recorded experts in every sparse layer (a DeltaNet and a full-attention one):
    the expert load (and MaxViolation) is their count over non-padding tokens, which free routing would not
    give, and the router still gets a gradient (the combine weights are its probabilities at those experts)."""
    src, _ = hf_model_dir("qwen3_5_moe_alt_tied")
    model, cfg = load_model(src, param_dtype="float32", compute_dtype="float32")
    b, t, ls, k, e = 2, 16, len(cfg.sparse_layers()), cfg.num_experts_per_tok, cfg.num_experts
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, size=(b, t)).astype(np.int32)
    positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    segments = np.ones((b, t), np.int32)
    segments[1, 11:] = 0  # padding: not counted in the load
    valid = segments > 0
    # experts a router would rarely pick all together: the same k experts for every token of a layer
    recorded = np.broadcast_to(np.arange(k, dtype=np.int32)[None, None, None] + np.arange(ls)[None, None, :, None],
                               (b, t, ls, k)).copy()  # fmt: skip
    graphdef, params = nnx.split(model)

    def run(p):
        h, stats = nnx.merge(graphdef, p).forward_with_aux(
            tokens, positions, segments, replay=(recorded, valid)
        )
        return jnp.sum(h[valid] ** 2), stats

    (_, stats), grads = jax.jit(jax.value_and_grad(run, has_aux=True))(params)
    expected = np.zeros((ls, e))
    for j in range(ls):
        expected[j, j : j + k] = valid.sum()
    np.testing.assert_array_equal(np.asarray(stats["load"]), expected)
    router_grad = np.abs(np.asarray(grads["layers"]["router"][...]))
    assert np.all(router_grad.max(axis=(1, 2)) > 0)  # every sparse layer's router
    mv = np.asarray(max_violation(stats["load"]))
    np.testing.assert_allclose(mv, e / k - 1)


def _qwen3_5_35b_a3b() -> dict:
    """Qwen3.5-35B-A3B's text_config as transformers 5.17's Qwen3_5MoeTextConfig defaults give it."""
    return dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        full_attention_interval=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, router_aux_loss_coef=0.001, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True),
    )  # fmt: skip


def test_qwen3_5_35b_a3b_config_round_trip_flops_and_params():
    import transformers

    cfg = ModelConfig.from_hf_config(_qwen3_5_35b_a3b())
    assert cfg.sparse_layers() == tuple(range(40)) and not cfg.dense_layers() and cfg.shared_width == 512
    assert len(cfg.full_attention_layers()) == 10 and cfg.norm_topk_prob and cfg.shared_expert_gate
    hf = cfg.to_hf_config()
    assert ModelConfig.from_hf_config(json.loads(json.dumps(hf))) == cfg
    assert hf["router_aux_loss_coef"] == 0.001  # transformers' training switch, written back unchanged
    # transformers reads the export's config into the same shape
    again = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    assert (again.num_experts, again.shared_expert_intermediate_size, again.layer_types) == (
        256,
        512,
        list(cfg.layer_types),
    )
    # 10 gated full-attention layers (q with its gate 2*16*256, k, v 2*256, o), 30 DeltaNet layers, and per
    # layer 8 routed experts + the shared one (3*2048*512 each), the router [2048, 256] and the shared gate
    full = 2048 * 16 * 512 + 2 * 2048 * 512 + 16 * 256 * 2048
    conv = 2 * 16 * 128 + 32 * 128
    linear = 2048 * conv + 2048 * 4096 + 2 * 2048 * 32 + 4096 * 2048
    moe = 9 * 3 * 2048 * 512 + 2048 * 256 + 2048
    matmul = 10 * full + 30 * linear + 40 * moe + 2048 * 248320
    assert cfg.num_matmul_params() == matmul
    per_linear = 6 * (32 * (64 * (3 * 128 + 2 * 128) + (64 * 64 - 1) // 3 + 3 * 128 * 128) + 4 * conv)
    # full attention over its own head width (256), not hidden/heads (128)
    assert cfg.flops_per_token(16384) == 6 * matmul + 12 * 10 * 16 * 256 * 16384 + 30 * per_linear
    assert 2.5e9 < matmul < 3.5e9  # published: 3B active
    assert 34e9 < cfg.num_params() < 36e9  # published: 35B (the language model, without the vision tower)


@pytest.mark.parametrize(
    "change, overrides, error",
    [
        (dict(num_experts=0), {}, "num_experts > 0"),
        ({}, dict(lora_rank=8, lora_alpha=16.0, lora_targets=("q_proj",)), "LoRA on qwen3_5_moe_text"),
        (dict(attention_bias=True), {}, "attention_bias"),
        ({}, dict(scan_layers=True), "hybrid stack runs unrolled"),
        (
            dict(model_type="qwen3_5_text", intermediate_size=512),
            dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
            "qwen3_5_text has no experts",
        ),
    ],
)
def test_qwen3_5_moe_configs_not_runnable_fail_clearly(change, overrides, error):
    with pytest.raises((ValueError, NotImplementedError), match=error):
        ModelConfig.from_hf_config({**_qwen3_5_35b_a3b(), **change}, **overrides)
