"""The trainer step's MoE metrics as logged scalars and TensorBoard histograms.

The step returns `moe/max_violation` [Ls] (per sparse layer, mean over the step's micro-batches of
(max expert load - mean load) / mean load) and `moe/load` [Ls, E] (token-expert pairs per expert over the step,
padding excluded). Logged: `moe/max_violation` (worst layer), `moe/max_violation_mean`, one scalar per layer
`moe/max_violation/layer_{i}` (i = the model layer), and one histogram of expert loads per layer
`moe/expert_load/layer_{i}` (each expert's share of the layer's pairs, so a balanced layer sits at 1/E).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def flatten_moe_metrics(
    metrics: Mapping[str, Any], layers: Sequence[int] | None = None
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """(scalars, histograms) from a step's metrics; non-MoE entries pass through as floats.

    `layers`: the model layer index of each sparse layer (default 0..Ls-1).
    """
    scalars: dict[str, float] = {}
    hists: dict[str, np.ndarray] = {}
    for k, v in metrics.items():
        if not k.startswith("moe/"):
            scalars[k] = float(v)
    if "moe/max_violation" in metrics:
        mv = np.asarray(metrics["moe/max_violation"], np.float64).reshape(-1)
        ids = list(layers) if layers is not None else list(range(mv.size))
        scalars["moe/max_violation"] = float(mv.max())
        scalars["moe/max_violation_mean"] = float(mv.mean())
        for i, v in zip(ids, mv, strict=True):
            scalars[f"moe/max_violation/layer_{i}"] = float(v)
        load = np.asarray(metrics["moe/load"], np.float64)
        for i, row in zip(ids, load, strict=True):
            hists[f"moe/expert_load/layer_{i}"] = row / max(row.sum(), 1.0)
        scalars["moe/lb_loss"] = float(metrics["moe/lb_loss"])
        scalars["moe/z_loss"] = float(metrics["moe/z_loss"])
    return scalars, hists
