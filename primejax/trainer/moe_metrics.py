"""The trainer step's MoE metrics as logged scalars and TensorBoard histograms.

The step returns `moe/max_violation` [Ls] (per sparse layer, mean over the step's micro-batches of
(max expert load - mean load) / mean load) and `moe/load` [Ls, E] (token-expert pairs per expert over the step,
padding excluded). Logged: `moe/max_violation` (worst layer), `moe/max_violation_mean`, one scalar per layer
`moe/max_violation/layer_{i}` (i = the model layer), and one histogram of expert loads per layer
`moe/expert_load/layer_{i}` (each expert's share of the layer's pairs, so a balanced layer sits at 1/E).

With experts split over devices (model.expert_parallel "a2a" or "ep", P > 1 devices along the experts axis):
`moe/device_load_max` (worst layer) and `moe/device_load_max_mean` (mean over layers), the busiest device's
pairs as a multiple of the balanced share (1.0 = even). Under "a2a" every exchange waits for that device: at
random init it held 1.35x on average over Qwen3-30B-A3B's 48 layers on 4 GPUs, 1.75x at worst, the main cost
of a2a against fsdp there (docs/benchmarks.md, docs/moe.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def expert_devices(model_cfg, mesh) -> int:
    """The devices a sparse layer's experts are split over: the experts axis's size when model.expert_parallel
    keeps each expert on one device ("a2a", "ep"), else 1 ("fsdp" gathers them; dense models)."""
    from primejax.models.moe import EP_AXIS

    if not model_cfg.num_experts or model_cfg.expert_parallel not in ("a2a", "ep") or mesh is None:
        return 1
    return int(dict(mesh.shape).get(EP_AXIS, 1))


def device_load_max(load: np.ndarray, devices: int) -> np.ndarray:
    """[Ls]: each layer's busiest device's share of the pairs over the balanced share, for expert loads
    `load` [Ls, E] with the experts split in `devices` contiguous blocks (the experts axis's layout)."""
    load = np.asarray(load, np.float64)
    if load.shape[-1] % devices:
        raise ValueError(f"{load.shape[-1]} experts do not split over {devices} devices")
    blocks = load.reshape(*load.shape[:-1], devices, -1).sum(-1)
    return blocks.max(-1) / np.maximum(blocks.mean(-1), 1e-30)


def flatten_moe_metrics(
    metrics: Mapping[str, Any], layers: Sequence[int] | None = None, expert_devices: int = 1
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """(scalars, histograms) from a step's metrics; non-MoE entries pass through as floats.

    `layers`: the model layer index of each sparse layer (default 0..Ls-1). `expert_devices`: the devices
    each layer's experts are split over (1: not split, no per-device figures).
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
        if expert_devices > 1:
            top = device_load_max(load, expert_devices)
            scalars["moe/device_load_max"] = float(top.max())
            scalars["moe/device_load_max_mean"] = float(top.mean())
        scalars["moe/lb_loss"] = float(metrics["moe/lb_loss"])
        scalars["moe/z_loss"] = float(metrics["moe/z_loss"])
    return scalars, hists
