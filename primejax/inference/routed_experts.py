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
# vLLM 0.31 returns routed experts only from its V2 model runner ("AuxOutput Connector requires Model Runner V2"),
# which needs Triton; on CPU primejax's capture (routed_capture.py, no-op elsewhere) stands in for it.
ROUTED_EXPERTS_ENV = {"PRIMEJAX_ROUTED_EXPERTS_CAPTURE": "1"}


@dataclass(frozen=True)
class RoutingShape:
    """What a routing row of one token looks like for a model: [num_layers (its MoE layers), top_k] expert ids,
    each below num_experts."""

    num_layers: int
    top_k: int
    num_experts: int
    #: the MoE layers' indices among all layers: vLLM's rows have a column per hidden layer (0 for dense ones)
    sparse_layers: tuple[int, ...] = ()

    @classmethod
    def of_model_dir(cls, model_dir: str | os.PathLike) -> RoutingShape | None:
        """From an HF model directory's config.json; None for a dense model."""
        from primejax.models.config import ModelConfig  # reads config.json only (no jax)

        cfg = ModelConfig.from_model_dir(model_dir)
        if not cfg.num_experts:
            return None
        return cls(len(cfg.sparse_layers()), cfg.num_experts_per_tok, cfg.num_experts, cfg.sparse_layers())


def request_fields(prompt_len: int) -> dict:
    """Extra body fields of a completion request whose reply should carry one routing row per completion token."""
    return {"routed_experts_prompt_start": max(int(prompt_len) - 1, 0)}


def decode(
    b64: str | None,
    completion_len: int,
    num_layers: int,
    top_k: int,
    num_experts: int = 256,
    sparse_layers: tuple[int, ...] = (),
    prompt_len: int = 0,
) -> np.ndarray:
    """uint8 [completion_len, layers, top_k] from a reply's `routed_experts` (requested via request_fields).

    `prompt_len` (the request's prompt tokens): a server that ignored `routed_experts_prompt_start` (vLLM's GPU
    builds before 0.31, primejax/inference/vllm_compat.py) returns one row per prompt token too, prompt_len +
    completion_len - 1 rows in all; the rows before the prompt's last token are dropped here.

    vLLM writes a column per hidden layer; with `sparse_layers` (the MoE layers' indices) a wider array keeps
    only those columns, so a model with dense layers (mlp_only_layers) gets its MoE layers' rows.

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
    if sparse_layers and arr.ndim == 3 and arr.shape[1] > max(sparse_layers) and arr.shape[1] != num_layers:
        arr = arr[:, list(sparse_layers)]
    if arr.ndim != 3 or arr.shape[1:] != (num_layers, top_k):
        raise ValueError(f"routed_experts: shape {arr.shape}, expected [tokens, {num_layers}, {top_k}]")
    if prompt_len > 1 and arr.shape[0] == prompt_len + completion_len - 1:
        arr = arr[prompt_len - 1 :]
    if arr.shape[0] < completion_len:
        raise ValueError(f"routed_experts: {arr.shape[0]} rows for {completion_len} completion tokens")
    arr = arr[:completion_len]
    if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
        raise ValueError(
            f"routed_experts: expert ids {int(arr.min())}..{int(arr.max())} outside "
            f"[0, num_experts={num_experts})"
        )
    if top_k > 1 and arr.size and (np.diff(np.sort(arr, axis=-1), axis=-1) == 0).any():
        # A top-k never repeats an expert; all-zero rows are what a layer that reported nothing leaves.
        raise ValueError("routed_experts: a token lists the same expert twice in one layer (not a top-k)")
    return np.ascontiguousarray(arr.astype(np.uint8))
