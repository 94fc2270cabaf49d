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
import os
from dataclasses import dataclass

import numpy as np

ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
# vLLM 0.31 returns routed experts only from its V2 model runner ("AuxOutput Connector requires Model Runner V2").
ROUTED_EXPERTS_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


@dataclass(frozen=True)
class RoutingShape:
    """What a routing row of one token looks like for a model: [num_layers (its MoE layers), top_k] expert ids,
    each below num_experts."""

    num_layers: int
    top_k: int
    num_experts: int

    @classmethod
    def of_model_dir(cls, model_dir: str | os.PathLike) -> RoutingShape | None:
        """From an HF model directory's config.json; None for a dense model."""
        from primejax.models.config import ModelConfig  # reads config.json only (no jax)

        cfg = ModelConfig.from_model_dir(model_dir)
        if not cfg.num_experts:
            return None
        return cls(len(cfg.sparse_layers()), cfg.num_experts_per_tok, cfg.num_experts)


def request_fields(prompt_len: int) -> dict:
    """Extra body fields of a completion request whose reply should carry one routing row per completion token."""
    return {"routed_experts_prompt_start": max(int(prompt_len) - 1, 0)}


def decode(
    b64: str | None, completion_len: int, num_layers: int, top_k: int, num_experts: int = 256
) -> np.ndarray:
    """uint8 [completion_len, layers, top_k] from a reply's `routed_experts` (requested via request_fields).

    Raises ValueError naming the field when the array is missing or its shape or values do not fit.
    """
    if b64 is None:
        raise ValueError(
            "routed_experts missing from the completion choice (server started without "
            f"{ROUTED_EXPERTS_FLAG}?)"
        )
    try:
        arr = np.load(io.BytesIO(base64.b64decode(b64, validate=True)), allow_pickle=False)
    except (ValueError, TypeError, OSError, EOFError) as e:
        raise ValueError(f"routed_experts: not a base64 .npy array ({type(e).__name__}: {e})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
        raise ValueError(
            f"routed_experts: dtype {getattr(arr, 'dtype', type(arr).__name__)}, expected integers"
        )
    if arr.ndim != 3 or arr.shape[1:] != (num_layers, top_k):
        raise ValueError(f"routed_experts: shape {arr.shape}, expected [tokens, {num_layers}, {top_k}]")
    if arr.shape[0] < completion_len:
        raise ValueError(f"routed_experts: {arr.shape[0]} rows for {completion_len} completion tokens")
    arr = arr[:completion_len]
    if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
        raise ValueError(
            f"routed_experts: expert ids {int(arr.min())}..{int(arr.max())} outside "
            f"[0, num_experts={num_experts})"
        )
    return np.ascontiguousarray(arr.astype(np.uint8))
