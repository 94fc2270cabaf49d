"""Logits parity with transformers (fp32) for every supported family, packed and unpacked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
from hf_variants import VARIANTS

from primejax.models.hf_io import load_model

TOL = 1e-4


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


@nnx.jit
def _logits(model, tokens, positions, segment_ids):
    return model.logits(tokens, positions, segment_ids)


def _fp32_model(model_dir):
    return load_model(model_dir, param_dtype="float32", compute_dtype="float32")[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_fp32(variant, hf_model_dir):
    model_dir, torch_model = hf_model_dir(variant)
    model = _fp32_model(model_dir)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, size=(2, 40), dtype=np.int32)
    positions = np.tile(np.arange(40, dtype=np.int32), (2, 1))
    ours = np.asarray(_logits(model, tokens, positions, np.ones_like(tokens)))
    ref = _hf_logits(torch_model, tokens)
    err = float(np.abs(ours - ref).max())
    assert err <= TOL, f"{variant}: max |logits - transformers| = {err:.3e} > {TOL}"
    print(f"{variant}: max abs logits diff vs transformers = {err:.2e}")


@pytest.mark.parametrize(
    "variant",
    [
        "qwen3_tied",
        "llama_rope3",
        "glm4_moe_g4_dense1",
        "deepseek_v3_qlora",
        "deepseek_v3_noqlora_tied",
        "qwen3_5_moe_hybrid",
        "qwen3_5_moe_alt_tied",
    ],
)
def test_packed_rows_equal_per_sample_logits(variant, hf_model_dir):
    """Three samples packed in one row (plus padding) and one alone in another row give each sample's
    own transformers logits: no attention across segments, positions restart per sample."""
    model_dir, torch_model = hf_model_dir(variant)
    model = _fp32_model(model_dir)
    rng = np.random.default_rng(1)
    lengths = [[7, 13, 5], [20]]
    row_len = 32
    samples = [[rng.integers(0, 512, size=n, dtype=np.int32) for n in row] for row in lengths]
    tokens = np.zeros((2, row_len), np.int32)
    positions = np.zeros((2, row_len), np.int32)
    segments = np.zeros((2, row_len), np.int32)
    for r, row in enumerate(samples):
        start = 0
        for s, sample in enumerate(row):
            n = len(sample)
            tokens[r, start : start + n] = sample
            positions[r, start : start + n] = np.arange(n)
            segments[r, start : start + n] = s + 1
            start += n
        # padding keeps a nonzero token id so a padding leak would show up in the logits
        tokens[r, start:] = 3
    ours = np.asarray(_logits(model, tokens, positions, segments))
    worst = 0.0
    for r, row in enumerate(samples):
        start = 0
        for sample in row:
            ref = _hf_logits(torch_model, sample[None])[0]
            worst = max(worst, float(np.abs(ours[r, start : start + len(sample)] - ref).max()))
            start += len(sample)
    assert worst <= TOL, f"{variant}: packed vs per-sample max abs diff {worst:.3e} > {TOL}"
    print(f"{variant}: packed vs per-sample transformers logits max abs diff = {worst:.2e}")
