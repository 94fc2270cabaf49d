"""Qwen3.5 (qwen3_5_text): the chunked gated delta rule against its recurrence, long packed rows against
transformers per sample, the multimodal checkpoint's language model, config accounting and refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_variants import write_multimodal_checkpoint

from primejax.models.config import ModelConfig
from primejax.models.deltanet import causal_conv, gated_delta_rule
from primejax.models.hf_io import load_model

TOL = 1e-4


def _recurrence(q, k, v, g, beta, seg):
    """The gated delta rule token by token (transformers' torch_recurrent_gated_delta_rule), the state zeroed
    where the segment id changes."""
    b, t, h, dk = k.shape
    out = np.zeros(v.shape, np.float64)
    for r in range(b):
        s = np.zeros((h, dk, v.shape[-1]))
        for i in range(t):
            if i == 0 or seg[r, i] != seg[r, i - 1]:
                s[:] = 0
            s = s * np.exp(g[r, i])[:, None, None]
            mem = np.einsum("hdv,hd->hv", s, k[r, i])
            delta = (v[r, i] - mem) * beta[r, i][:, None]
            s = s + k[r, i][:, :, None] * delta[:, None, :]
            out[r, i] = np.einsum("hdv,hd->hv", s, q[r, i])
    return out


@pytest.mark.parametrize("chunk", [8, 64])
def test_chunked_rule_equals_recurrence_with_segment_resets(chunk):
    """Segments start inside chunks, span chunk boundaries and fill whole chunks; padding (0) closes rows."""
    rng = np.random.default_rng(0)
    b, t, h, dk, dv = 2, 70, 3, 8, 6
    q = rng.normal(size=(b, t, h, dk))
    k = rng.normal(size=(b, t, h, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    v = rng.normal(size=(b, t, h, dv))
    g = -rng.uniform(0.0, 0.5, size=(b, t, h))
    beta = rng.uniform(0.0, 1.0, size=(b, t, h))
    seg = np.zeros((b, t), np.int32)
    seg[0, :5], seg[0, 5:37], seg[0, 37:66] = 1, 2, 3
    seg[1, :] = 1
    ref = _recurrence(q, k, v, g, beta, seg)
    rule = jax.jit(gated_delta_rule, static_argnames="chunk")
    ours = np.asarray(rule(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)), seg, chunk=chunk))
    err = float(np.abs(ours - ref).max())
    assert err < 1e-4, f"chunk {chunk}: chunked vs recurrent max abs diff {err:.2e}"
    # Without the resets the packed samples would read each other's state.
    mixed = np.asarray(
        rule(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)), np.ones_like(seg), chunk=chunk)
    )
    assert np.abs(mixed[0, 5:37] - ref[0, 5:37]).max() > 1e-2


def test_conv_does_not_cross_segments():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(1, 9, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 2, 0]])
    conv = jax.jit(causal_conv)
    packed = conv(x, w, seg)
    alone = conv(x[:, 3:8], w, jnp.ones((1, 5), jnp.int32))
    np.testing.assert_allclose(packed[:, 3:8], alone, atol=1e-6)


@nnx.jit
def _logits(model, tokens, positions, segment_ids):
    return model.logits(tokens, positions, segment_ids)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize(
    "variant",
    [
        "qwen3_5_hybrid",
        pytest.param("qwen3_5_alt_tied", marks=pytest.mark.slow),
        pytest.param("qwen3_5_moe_hybrid", marks=pytest.mark.slow),
    ],
)
def test_long_packed_rows_equal_per_sample_transformers_logits(variant, hf_model_dir):
    """Rows of 160 tokens (three 64-token chunks): samples start mid-chunk and span chunk boundaries."""
    model_dir, torch_model = hf_model_dir(variant)
    model = load_model(model_dir, param_dtype="float32", compute_dtype="float32")[0]
    rng = np.random.default_rng(2)
    lengths = [[70, 50, 25], [130]]
    row_len = 160
    samples = [[rng.integers(0, 512, size=n, dtype=np.int32) for n in row] for row in lengths]
    tokens = np.full((2, row_len), 3, np.int32)
    positions = np.zeros((2, row_len), np.int32)
    segments = np.zeros((2, row_len), np.int32)
    for r, row in enumerate(samples):
        start = 0
        for s, sample in enumerate(row):
            tokens[r, start : start + len(sample)] = sample
            positions[r, start : start + len(sample)] = np.arange(len(sample))
            segments[r, start : start + len(sample)] = s + 1
            start += len(sample)
    ours = np.asarray(_logits(model, tokens, positions, segments))
    worst = 0.0
    for r, row in enumerate(samples):
        start = 0
        for sample in row:
            ref = _hf_logits(torch_model, sample[None])[0]
            worst = max(worst, float(np.abs(ours[r, start : start + len(sample)] - ref).max()))
            start += len(sample)
    assert worst <= TOL, f"{variant}: packed vs per-sample max abs diff {worst:.3e}"
    print(f"{variant}: 160-token packed rows vs per-sample transformers logits max abs diff = {worst:.2e}")


def test_multimodal_checkpoint_loads_its_language_model(hf_model_dir, tmp_path):
    """A Qwen3_5ForConditionalGeneration-style directory: config under text_config, tensors under
    model.language_model.*, plus a vision tensor that is not read. Same logits as the text checkpoint."""
    src, torch_model = hf_model_dir("qwen3_5_hybrid")
    write_multimodal_checkpoint(src, tmp_path, "qwen3_5")
    model, cfg = load_model(tmp_path, param_dtype="float32", compute_dtype="float32")
    assert cfg.model_type == "qwen3_5_text" and cfg.to_hf_config()["architectures"] == ["Qwen3_5ForCausalLM"]
    tokens = np.random.default_rng(3).integers(0, 512, size=(1, 30)).astype(np.int32)
    ours = np.asarray(_logits(model, tokens, np.arange(30, dtype=np.int32)[None], np.ones_like(tokens)))
    err = float(np.abs(ours - _hf_logits(torch_model, tokens)).max())
    assert err <= TOL, err


@pytest.mark.parametrize(
    "variant", ["qwen3_5_hybrid", "qwen3_5_alt_tied", "qwen3_5_moe_hybrid", "qwen3_5_moe_alt_tied"]
)
def test_param_count_equals_transformers(variant, hf_model_dir):
    src, torch_model = hf_model_dir(variant)
    cfg = ModelConfig.from_model_dir(src)
    assert cfg.num_params() == sum(p.numel() for p in torch_model.parameters())
    assert cfg.layer_types == tuple(torch_model.config.layer_types)


def _qwen3_5_9b() -> dict:
    """Qwen3.5-9B's text_config (the published config.json's shape)."""
    return dict(
        model_type="qwen3_5_text",
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        full_attention_interval=4,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10000000.0,
            partial_rotary_factor=0.25,
            mrope_section=[11, 11, 10],
            mrope_interleaved=True,
        ),
    )


def test_qwen3_5_9b_config_round_trip_flops_and_params():
    cfg = ModelConfig.from_hf_config(_qwen3_5_9b())
    assert cfg.linear_attention_layers() == tuple(i for i in range(32) if i % 4 != 3)
    assert cfg.rotary_dim == 64 and cfg.norm_offset and cfg.attn_output_gate
    again = ModelConfig.from_hf_config(json.loads(json.dumps(cfg.to_hf_config())))
    assert again == cfg
    # 8 full-attention layers (q with its gate 2*16*256, k, v 4*256, o) and 24 DeltaNet layers
    full = 4096 * 16 * 512 + 2 * 4096 * 1024 + 16 * 256 * 4096
    conv = 2 * 16 * 128 + 32 * 128
    linear = 4096 * conv + 4096 * 4096 + 2 * 4096 * 32 + 4096 * 4096
    matmul = 8 * full + 24 * linear + 32 * 3 * 4096 * 12288 + 4096 * 248320
    assert cfg.num_matmul_params() == matmul
    per_linear = 6 * (32 * (64 * (3 * 128 + 2 * 128) + (64 * 64 - 1) // 3 + 3 * 128 * 128) + 4 * conv)
    assert cfg.flops_per_token(16384) == 6 * matmul + 12 * 8 * 16 * 256 * 16384 + 24 * per_linear
    # published: 9B parameters (the language model, without the vision tower)
    assert 8.5e9 < cfg.num_params() < 9.5e9


@pytest.mark.parametrize(
    "change, overrides, error",
    [
        (dict(attention_bias=True), {}, "attention_bias"),
        ({}, dict(scan_layers=True), "hybrid stack runs unrolled"),
        (dict(linear_num_key_heads=3), {}, "multiple of"),
        (dict(layer_types=["full_attention"] * 31 + ["mamba"]), {}, "layer_types"),
    ],
)
def test_qwen3_5_configs_not_runnable_fail_clearly(change, overrides, error):
    with pytest.raises((ValueError, NotImplementedError), match=error):
        ModelConfig.from_hf_config({**_qwen3_5_9b(), **change}, **overrides)


def _run_emulated(script: str, devices: int, out: Path, *args) -> dict:
    """Run tests/models/`script` OUT_JSON ARGS... in a subprocess on `devices` emulated CPU devices; its JSON."""
    env = dict(
        os.environ,
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
    )
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script)), str(out), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


# context 4 (extended tier: a second compile): the 2 key heads cannot be split 4 ways, repeated before the switch
@pytest.mark.parametrize("context", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_split_deltanet_layer_equals_one_device_by_all_to_all(context, tmp_path):
    """One DeltaNet layer on fsdp 2 x context 2 (4 emulated devices, deltanet_cp_check.py): rows of 192 tokens
    split in halves, segments straddling the split and the 64-token chunks; output and every gradient equal
    one device's, and the compiled program switches layout by all-to-alls without moving a whole row (with the
    head split removed XLA all-gathers q, k, v, g and beta over the row instead)."""
    r = _run_emulated("deltanet_cp_check.py", 4, tmp_path / "r.json", context)
    assert r["out_diff"] <= 1e-5, r
    # relative to each gradient's largest entry (fp32 sums in another order; measured <= 1.1e-6)
    assert max(r["grad_diff"].values()) <= 1e-4 and len(r["grad_diff"]) == 10, r
    assert r["all_to_all"] > 0 and r["whole_row"] == [], r


def test_context_split_refuses_value_heads_it_cannot_divide():
    """4 value heads on tensor 2 x context 4: one line with the numbers (replicated heads would run the whole
    recurrence on every device)."""
    from jax.sharding import AbstractMesh, AxisType

    from primejax.models import deltanet
    from primejax.models.sharding import MESH_AXES

    cfg = ModelConfig.from_hf_config(
        {**_qwen3_5_9b(), "linear_num_value_heads": 4, "linear_num_key_heads": 2}
    )
    mesh = AbstractMesh((1, 1, 4, 2), MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    with jax.sharding.use_abstract_mesh(mesh):
        with pytest.raises(ValueError, match=r"4 Gated DeltaNet value heads .* tensor x context = 8"):
            deltanet.gated_deltanet(cfg, {}, jnp.zeros((1, 8, 4096)), jnp.ones((1, 8), jnp.int32))
        deltanet.check_heads(8)  # 8 heads split 8 ways: accepted


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant, meshes",
    [("qwen3_5_hybrid", "tensor"), ("qwen3_5_hybrid", "context"), ("qwen3_5_moe_hybrid", "context")],
)
def test_meshes_equal_one_device(variant, meshes, hf_model_dir, tmp_path):
    """8 emulated devices (qwen3_5_mesh_check.py in a subprocess): `tensor`, a data x fsdp x tensor mesh;
    `context`, data 2 x fsdp 2 x context 2 and data 2 x context 4 (rows of 96 tokens in 48- or 24-token shards,
    segments straddling them and the 64-token chunk boundary). Each gives the single device's logits, loss and
    every gradient; two trainer steps on the first context mesh give one device's losses and parameters; and
    tensor 2 x context 4 (8 ways for 4 value heads) fails with the one line. Qwen3.5 MoE (same hybrid stack,
    every MLP sparse) on the context meshes too (its tensor mesh is test_moe_mesh.py's)."""
    model_dir, _ = hf_model_dir(variant)
    res = _run_emulated("qwen3_5_mesh_check.py", 8, tmp_path / "result.json", model_dir, meshes)
    for name, r in res["cases"].items():
        assert r["logits_diff"] <= 1e-5 and r["loss_diff"] <= 1e-5, (name, r)
        # relative to each gradient's largest entry; measured 2.5e-5 (fp32 sums in another order through the
        # chunks' UT inverses and the state scan), against 1e-5 for the attention-only families
        assert r["grad_diff"] <= 1e-4, (name, r)
        heads = "tensor" if meshes == "tensor" else "None"  # the weights' head split (tensor) only
        assert r["lin_z_spec"][2] == heads and r["lin_out_spec"][1] == heads, (name, r)
        print(
            f"{name}: logits {r['logits_diff']:.1e}, loss {r['loss_diff']:.1e}, gradients {r['grad_diff']:.1e}"
        )
    assert len(res["cases"]) == (1 if meshes == "tensor" else 2)
    if meshes == "context":
        s = res["steps"]
        assert s["losses"] == pytest.approx(s["ref_losses"], rel=1e-5) and s["losses"][1] < s["losses"][0], s
        # ||a - b|| / ||b|| after two Adam steps at lr 1e-2 (which turns the gradients' reduction-order noise in
        # ~0 entries into lr-sized steps): measured 1.5e-4 dense, 6.2e-5 MoE, against 1e-4 for the attention-only
        # models (test_context_parallel.py), as the gradients' 2.5e-5 against 1e-5
        assert s["params_rel_norm"] < 5e-4, s
        print(
            f"trainer steps on data2_fsdp2_context2: losses {s['losses']}, params {s['params_rel_norm']:.1e}"
        )
        assert "4 Gated DeltaNet value heads" in res["context_error"], res["context_error"]


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_tiny_qwen3_5_build_matches_its_section_and_transformers(family, tmp_path):
    """`model.build_tiny.family=qwen3_5_text` (or `qwen3_5_moe_text`) writes the structure its section's
    `architecture()` describes, and primejax's logits on it equal transformers' (fp32)."""
    import transformers

    from primejax.models.tiny import TinyModelConfig

    section = TinyModelConfig(enabled=True, family=family, num_layers=2, num_heads=2, num_kv_heads=1)
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
        "layer_types",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "attn_output_gate",
        "norm_offset",
        "partial_rotary_factor",
        "qk_norm",
        "tie_word_embeddings",
        "intermediate_size",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "shared_width",
        "shared_expert_gate",
    ):
        assert getattr(built, f) == getattr(described, f), f
    assert built.layer_types == ("linear_attention", "full_attention")
    model, _ = load_model(path, param_dtype="float32", compute_dtype="float32")
    tokens = np.random.default_rng(0).integers(0, built.vocab_size, size=(1, 24)).astype(np.int32)
    ours = np.asarray(_logits(model, tokens, np.arange(24, dtype=np.int32)[None], np.ones_like(tokens)))
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert float(np.abs(ours - _hf_logits(torch_model, tokens)).max()) <= TOL


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): a whole Qwen3.5 step compile
def test_weight_decay_spares_the_deltanet_decay_rates_norm_and_dt_bias():
    """AdamW decay (trainer/optim.py) moves the DeltaNet matrices and conv, not A_log, dt_bias or its norm."""
    from primejax.models.tiny import TinyModelConfig
    from primejax.models.transformer import init_model
    from primejax.trainer import optim

    cfg = TinyModelConfig(family="qwen3_5_text", vocab_size=128, hidden_size=32, head_dim=32).architecture()
    params = nnx.state(init_model(cfg, None, seed=0), nnx.Param)
    opt = optim.make_optimizer(
        dict(max_norm=0.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.5), optim.make_schedule(1.0)
    )
    updates, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
    moved = {}
    for path, u in jax.tree_util.tree_leaves_with_path(updates):
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        moved[[n for n in names if n and n != "value"][-1]] = bool(np.any(np.asarray(u) != 0))
    assert moved["lin_qkv"] and moved["lin_conv"] and moved["lin_out"] and moved["q_proj"]
    assert not (moved["lin_A_log"] or moved["lin_dt_bias"] or moved["lin_norm"] or moved["attn_norm"])
