"""Decoding vLLM's `routed_experts` (base64 .npy) into the compact uint8 rows the batch would carry."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from primejax.inference.routed_experts import decode, request_fields


def _b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def test_decode_keeps_one_row_per_completion_token_as_uint8():
    arr = np.random.default_rng(0).integers(0, 128, size=(7, 3, 8)).astype(np.int32)
    out = decode(_b64(arr), completion_len=5, num_layers=3, top_k=8)
    assert out.dtype == np.uint8 and out.shape == (5, 3, 8)
    np.testing.assert_array_equal(out, arr[:5])
    assert request_fields(12) == {"routed_experts_prompt_start": 11}


@pytest.mark.parametrize(
    "arr,match",
    [
        (np.zeros((4, 2, 8), np.uint8), "shape"),
        (np.zeros((2, 3, 8), np.uint8), "2 rows for 5"),
        (np.full((6, 3, 8), 300, np.int32), "num_experts"),
    ],
)
def test_decode_rejects_bad_arrays_with_one_line(arr, match):
    with pytest.raises(ValueError, match=match):
        decode(_b64(arr), completion_len=5, num_layers=3, top_k=8)


def test_decode_names_missing_field():
    with pytest.raises(ValueError, match="enable-return-routed-experts"):
        decode(None, 3, 2, 2)
