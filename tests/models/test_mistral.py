"""Mistral (models/families/mistral.py), the family added as one file: logits against transformers'
MistralForCausalLM in fp32, the HF safetensors round trip, and the sliding window it refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from primejax.models.config import ModelConfig
from primejax.models.hf_io import export_safetensors, load_model

TOL = 1e-4  # fp32 logits, as test_parity.py


def _tiny_mistral(out_dir, **overrides):
    """A random MistralForCausalLM (GQA 4:2, untied, rope theta 1e6, sliding_window null), saved as HF writes it."""
    config = transformers.MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=1e6,
        tie_word_embeddings=False, sliding_window=None, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(str(out_dir))
    return model


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


@nnx.jit
def _logits(model, tokens, positions, segment_ids):
    return model.logits(tokens, positions, segment_ids)


def test_mistral_logits_match_transformers_and_round_trip(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    torch_model = _tiny_mistral(src)
    model, cfg = load_model(src, param_dtype="float32", compute_dtype="float32")
    assert cfg.model_type == "mistral" and not cfg.qk_norm and not cfg.attention_bias

    tokens = np.random.default_rng(0).integers(0, 512, size=(2, 40), dtype=np.int32)
    positions = np.tile(np.arange(40, dtype=np.int32), (2, 1))
    ref = _torch_logits(torch_model, tokens)
    err = float(np.abs(np.asarray(_logits(model, tokens, positions, np.ones_like(tokens))) - ref).max())
    assert err <= TOL, f"max |logits - transformers| = {err:.3e} > {TOL}"
    print(f"mistral: max abs logits diff vs transformers = {err:.2e}")

    export_safetensors(model, cfg, out, dtype=None, src_dir=src)
    before = load_file(src / "model.safetensors")
    after = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(after) == sorted(before)
    for name, t in before.items():
        assert np.array_equal(after[name].view(np.uint8), t.view(np.uint8)), f"{name} differs bitwise"
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["MistralForCausalLM"] and written["sliding_window"] is None
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded) is transformers.MistralForCausalLM
    assert float(np.abs(_torch_logits(reloaded, tokens) - ref).max()) == 0.0


def test_mistral_config_round_trips_and_refuses_a_sliding_window():
    hf = transformers.MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=None,
    ).to_dict()  # fmt: skip
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.head_dim == 16 and ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    # a window as long as the positions never masks anything: read, and written back unchanged
    assert ModelConfig.from_hf_config({**hf, "sliding_window": 256}).to_hf_config()["sliding_window"] == 256
    with pytest.raises(NotImplementedError, match="sliding_window=128 < max_position_embeddings"):
        ModelConfig.from_hf_config({**hf, "sliding_window": 128})
