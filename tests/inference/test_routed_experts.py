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
    # distinct experts per (token, layer), as a top-k is
    arr = np.argsort(np.random.default_rng(0).random((7, 3, 128)), axis=-1)[..., :8].astype(np.int32)
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
        (np.zeros((6, 3, 8), np.uint8), "same expert twice"),
    ],
)
def test_decode_rejects_bad_arrays_with_one_line(arr, match):
    with pytest.raises(ValueError, match=match):
        decode(_b64(arr), completion_len=5, num_layers=3, top_k=8)


def test_decode_names_missing_field():
    with pytest.raises(ValueError, match="enable-return-routed-experts"):
        decode(None, 3, 2, 2)


def test_decode_drops_the_prompt_rows_of_a_server_that_ignored_the_prompt_start():
    """vLLM's GPU builds before 0.31 ignore `routed_experts_prompt_start` and return a row for every token but the
    last (prompt_len + completion_len - 1): the completion's rows start at the prompt's last token."""
    prompt_len, completion_len, layers, top_k = 5, 3, 2, 2
    rows = np.stack([np.full((layers, top_k), 0) + [0, 1] for _ in range(prompt_len + completion_len - 1)])
    rows[:, 0, 0] = (
        np.arange(len(rows)) % 4 * 2
    )  # a distinct, valid top-k per row: row i names expert 2(i % 4)
    rows[:, 0, 1] = rows[:, 0, 0] + 1
    out = decode(_b64(rows.astype(np.uint8)), completion_len, layers, top_k, 8, prompt_len=prompt_len)
    np.testing.assert_array_equal(out, rows[prompt_len - 1 :])
    # A server that honoured the prompt start returns exactly the completion's rows: kept as they are.
    honoured = rows[prompt_len - 1 :].astype(np.uint8)
    np.testing.assert_array_equal(
        decode(_b64(honoured), completion_len, layers, top_k, 8, prompt_len=prompt_len), honoured
    )
