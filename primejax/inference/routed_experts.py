"""Routed experts returned by vLLM (routing replay, "R3"): request field and response decoding.

A server started with `--enable-return-routed-experts` (vLLM 0.31) puts `choices[i].routed_experts` in
`/v1/completions` replies: base64 of a `.npy` array [tokens - 1, layers, top_k] (uint8 up to 256 experts),
row t = the experts token t was routed to in each MoE layer; the last sampled token was never forwarded and
has no row. `routed_experts_prompt_start` = s skips the first s rows.

primejax asks for s = prompt_len - 1: row j is then the routing of the position whose forward predicts
completion token j (the prompt's last token for j = 0), one row per completion token, and the batch stores
row j with completion token j (contracts/batch.py keeps streams per target token; the trainer's one-left
shift puts it back on the predicting position).
"""

from __future__ import annotations

import base64
import io

import numpy as np

ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
# vLLM 0.31 returns routed experts only from its V2 model runner ("AuxOutput Connector requires Model Runner V2").
ROUTED_EXPERTS_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def request_fields(prompt_len: int) -> dict:
    """Extra body fields of a completion request whose reply should carry one routing row per completion token."""
    return {"routed_experts_prompt_start": max(int(prompt_len) - 1, 0)}


def decode(b64: str | None, completion_len: int, num_layers: int, top_k: int) -> np.ndarray:
    """uint8 [completion_len, layers, top_k] from a reply's `routed_experts` (requested via request_fields).

    Raises ValueError naming the field when the array is missing or its shape or values do not fit.
    """
    if b64 is None:
        raise ValueError(
            "routed_experts missing from the completion choice (server started without "
            f"{ROUTED_EXPERTS_FLAG}?)"
        )
    arr = np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)
    if arr.ndim != 3 or arr.shape[1:] != (num_layers, top_k):
        raise ValueError(f"routed_experts: shape {arr.shape}, expected [tokens, {num_layers}, {top_k}]")
    if arr.shape[0] < completion_len:
        raise ValueError(f"routed_experts: {arr.shape[0]} rows for {completion_len} completion tokens")
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise ValueError("routed_experts: expert ids outside 0..255 do not fit uint8")
    return np.ascontiguousarray(arr[:completion_len].astype(np.uint8))
