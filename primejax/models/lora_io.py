"""LoRA adapters <-> a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`).

The tensors are named and laid out as PEFT saves them for the HF model (and as vLLM's LoRA loader reads them):
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r],
the MoE experts one adapter per expert (`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`), the router
`mlp.gate`. Our stacked layouts are models/lora.py's; `export_peft` and `read_peft` are inverse of each other.

`merge_peft` is the merged-weights export: the base HF directory plus an adapter directory -> an HF directory
of W + s·A·B (tools/convert_checkpoint.py `merge-lora`).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from primejax.models import lora
from primejax.models.config import ModelConfig
from primejax.models.hf_io import _layer_indices, abstract_model, export_safetensors, load_model
from primejax.utils.io import atomic_dir

PREFIX = "base_model.model.model.layers"
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# our adapted dense weight -> the HF module under model.layers.{i}
DENSE_MODULES = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj", "router": "mlp.gate",
}  # fmt: skip
# per-expert modules: (our stacked weight, index on its gate/up axis or None, HF module under mlp.experts.{e})
EXPERT_MODULES = (
    ("experts_gate_up", 0, "gate_proj"),
    ("experts_gate_up", 1, "up_proj"),
    ("experts_down", None, "down_proj"),
)


class AdapterError(ValueError):
    """An adapter directory that does not fit the model (missing or misshapen tensors, another rank)."""


def _key(i: int, module: str, ab: str) -> str:
    return f"{PREFIX}.{i}.{module}.lora_{ab}.weight"


def peft_tensors(layers: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """PEFT's tensors of the stacked adapters `layers` (the `layers` part of `split_adapters`' first dict)."""
    r = cfg.lora_rank
    out: dict[str, np.ndarray] = {}
    for w, module in DENSE_MODULES.items():
        if w + lora.SUFFIX_A not in layers:
            continue
        a, b = layers[w + lora.SUFFIX_A], layers[w + lora.SUFFIX_B]
        for j, i in enumerate(_layer_indices(w, cfg)):
            out[_key(i, module, "A")] = a[j].reshape(-1, r).T
            out[_key(i, module, "B")] = b[j].reshape(r, -1).T
    if "experts_gate_up" + lora.SUFFIX_A in layers:
        for j, i in enumerate(cfg.sparse_layers()):
            for e in range(cfg.num_experts):
                for w, c, module in EXPERT_MODULES:
                    a, b = layers[w + lora.SUFFIX_A][j, e], layers[w + lora.SUFFIX_B][j, e]
                    a, b = (a, b) if c is None else (a[:, c], b[c])  # [in, r], [r, out]
                    out[_key(i, f"mlp.experts.{e}.{module}", "A")] = a.T
                    out[_key(i, f"mlp.experts.{e}.{module}", "B")] = b.T
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def target_modules(cfg: ModelConfig) -> list[str]:
    """PEFT's `target_modules` (HF module names) for our targets."""
    names = {DENSE_MODULES[t].rsplit(".", 1)[-1] for t in cfg.lora_targets if t in DENSE_MODULES}
    if "experts" in cfg.lora_targets:
        names |= {m for _, _, m in EXPERT_MODULES}
    return sorted(names)


def export_peft(
    adapters: dict,
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    base_model: str = "",
    overwrite: bool = False,
) -> Path:
    """Write a PEFT adapter directory (atomically) from the adapters (`split_adapters(...)[0]`, any sharding)."""
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        write_peft(adapters, cfg, tmp, base_model=base_model)
    return Path(out_dir)


def peft_config(cfg: ModelConfig, base_model: str = "") -> dict:
    """The `adapter_config.json` of our adapters for `cfg` (plain LoRA, PEFT's keys)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": target_modules(cfg),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "init_lora_weights": True,
    }


def adapter_tensors(adapters: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """PEFT's named fp32 host tensors of the adapters (`split_adapters(...)[0]`, gathered): what `write_peft`
    writes and the collective adapter round sends."""
    layers = {k: np.asarray(jax.device_get(v), np.float32) for k, v in adapters["layers"].items()}
    return peft_tensors(layers, cfg)


def write_peft(
    adapters: dict, cfg: ModelConfig, directory: str | os.PathLike, *, base_model: str = ""
) -> int:
    """Write the PEFT files into an existing directory (the trainer's broadcast writes through its own temp
    directory); return the bytes written."""
    d = Path(directory)
    save_file(adapter_tensors(adapters, cfg), str(d / WEIGHTS), metadata={"format": "pt"})
    (d / CONFIG).write_text(json.dumps(peft_config(cfg, base_model), indent=2) + "\n")
    return (d / WEIGHTS).stat().st_size + (d / CONFIG).stat().st_size


def adapter_settings(adapter_dir: str | os.PathLike) -> dict:
    """The `ModelConfig` LoRA fields an adapter directory describes (rank, alpha, our target names)."""
    path = Path(adapter_dir)
    try:
        config = json.loads((path / CONFIG).read_text())
        keys = set(load_file(str(path / WEIGHTS)))
    except FileNotFoundError as e:
        raise AdapterError(
            f"{adapter_dir}: not a PEFT adapter directory ({Path(e.filename).name} missing)"
        ) from None
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise AdapterError(
            f"{adapter_dir}: only plain LoRA adapters are supported (peft_type LORA, no DoRA/rsLoRA)"
        )
    targets = [w for w, m in DENSE_MODULES.items() if any(f".{m}.lora_A" in k for k in keys)]
    if any(".mlp.experts." in k for k in keys):
        targets.append("experts")
    return {
        "lora_rank": int(config["r"]),
        "lora_alpha": float(config["lora_alpha"]),
        "lora_targets": tuple(targets),
    }


def read_peft(adapter_dir: str | os.PathLike, cfg: ModelConfig) -> dict:
    """The adapters of a PEFT directory in our stacked layout ({"layers": {...}}, fp32 numpy) for `cfg`."""
    tensors = load_file(str(Path(adapter_dir) / WEIGHTS))
    shapes = lora.stack_adapters(nnx.eval_shape(lambda: _stack(cfg)), cfg)

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise AdapterError(f"{adapter_dir}: tensor {name} is missing")
        t = tensors[name]
        if t.shape != shape:
            raise AdapterError(f"{adapter_dir}: tensor {name} has shape {t.shape}, expected {shape}")
        return t

    r = cfg.lora_rank
    layers: dict[str, np.ndarray] = {}
    for w, s in shapes.items():
        a, b = np.empty(s.a_shape, np.float32), np.empty(s.b_shape, np.float32)
        if w in DENSE_MODULES:
            n_in, n_out = int(np.prod(s.a_shape[1:-1])), int(np.prod(s.b_shape[2:]))
            for j, i in enumerate(_layer_indices(w, cfg)):
                a[j] = get(_key(i, DENSE_MODULES[w], "A"), (r, n_in)).T.reshape(s.a_shape[1:])
                b[j] = get(_key(i, DENSE_MODULES[w], "B"), (n_out, r)).T.reshape(s.b_shape[1:])
        else:
            for j, i in enumerate(cfg.sparse_layers()):
                for e in range(cfg.num_experts):
                    for ww, c, module in EXPERT_MODULES:
                        if ww != w:
                            continue
                        n_in, n_out = s.a_shape[2], s.b_shape[-1]
                        ta = get(_key(i, f"mlp.experts.{e}.{module}", "A"), (r, n_in)).T
                        tb = get(_key(i, f"mlp.experts.{e}.{module}", "B"), (n_out, r)).T
                        if c is None:
                            a[j, e], b[j, e] = ta, tb
                        else:
                            a[j, e, :, c], b[j, e, c] = ta, tb
        layers[w + lora.SUFFIX_A], layers[w + lora.SUFFIX_B] = a, b
    return {"layers": layers}


@functools.lru_cache(maxsize=8)
def _merger(cfg: ModelConfig) -> tuple[nnx.GraphDef, Any]:
    """(the plain model's graph, the jitted merge) for `cfg`: built once, every export after reuses them."""
    return nnx.graphdef(abstract_model(lora.without_lora(cfg))), jax.jit(
        functools.partial(lora.merge_adapters, cfg=cfg)
    )


def merged_model(params: dict, cfg: ModelConfig) -> nnx.Module:
    """A plain Transformer (no adapters) whose weights are `lora.merge_adapters(params)` (jitted, sharding kept)."""
    graphdef, merge = _merger(cfg)
    return nnx.merge(graphdef, merge(params))


def _stack(cfg: ModelConfig):
    from primejax.models.transformer import DecoderStack

    return DecoderStack(lora.without_lora(cfg), rngs=nnx.Rngs(0))


def merge_peft(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str | None = "bfloat16",
    overwrite: bool = False,
) -> dict:
    """Write base + adapter merged (W + s·A·B) as an HF directory; returns `export_safetensors`' stats."""
    model, cfg = load_model(base_dir, param_dtype="float32", **adapter_settings(adapter_dir))
    params = nnx.to_pure_dict(nnx.state(model))
    _, frozen = lora.split_adapters(params)
    merged = merged_model(lora.join_params(read_peft(adapter_dir, cfg), frozen), cfg)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        return export_safetensors(merged, lora.without_lora(cfg), tmp, dtype=dtype, src_dir=base_dir)


__all__ = [
    "AdapterError",
    "adapter_settings",
    "adapter_tensors",
    "export_peft",
    "merge_peft",
    "merged_model",
    "peft_config",
    "peft_tensors",
    "read_peft",
]
