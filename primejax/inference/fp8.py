"""FP8 rollouts: what an FP8 server must serve after a weight update, computed on the host.

`inference.quantization` selects one of vLLM's online FP8 schemes (the server loads the bf16 weights the trainer
publishes and quantizes them itself, at start and again at every in-place update through vLLM's layerwise
reload, docs/fp8.md):

- `fp8`: per-tensor e4m3 (vLLM's `Fp8PerTensorOnline*Method`): one fp32 scale per linear weight (a fused
  q/k/v or gate/up matrix is one tensor) and one per expert matrix; activations quantized per token on the fly.
- `fp8_per_block`: e4m3 with one fp32 scale per 128 x 128 block, the layout DeepSeek-V3 and Qwen3-FP8
  checkpoints store (`weight_scale_inv`); activations per 128-wide group.

The functions below restate vLLM's quantization arithmetic in numpy (scale = amax / 448; q = e4m3(x * (1 /
scale)), round to nearest even, saturated) so a test can read back what a server serves (POST /weights_read)
and compare it with the quantization of the weights the trainer sent. tests/inference/test_fp8.py checks them
against vLLM's own per-block function and an independent float64 rounding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import ml_dtypes
import numpy as np

# Each scheme and vLLM's online-quantization shorthand for it (`--quantization`, vllm/config/quantization.py).
VLLM_SCHEMES = {"fp8": "fp8_per_tensor", "fp8_per_block": "fp8_per_block"}
QUANTIZATIONS = tuple(VLLM_SCHEMES)
# Left in the serving dtype: MoE routers (Qwen3-MoE / GLM / DeepSeek `mlp.gate`, Qwen2-MoE's shared-expert gate).
# A router's output width is the expert count, which a 128-wide block cannot tile (a tiny Qwen3-MoE's 8-expert
# router stopped an fp8_per_block server at start on an H200), and an FP8 router would choose other experts than
# the trainer's: the mismatch the corrections see should be the weights', not a different routing.
UNQUANTIZED = ("re:.*\\.mlp\\.gate$", "re:.*\\.shared_expert_gate$")
E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = float(ml_dtypes.finfo(E4M3).max)  # 448
BLOCK = (128, 128)
_BLOCK_AMAX_FLOOR = 1e-4  # vLLM's per-block cast clamps each block's amax from below (an all-zero block)


def vllm_args(quantization: str) -> list[str]:
    """vLLM's command-line arguments for one of QUANTIZATIONS: the online scheme, routers left unquantized."""
    _check(quantization)
    return [
        "--quantization",
        VLLM_SCHEMES[quantization],
        "--quantization-config",
        json.dumps({"ignore": UNQUANTIZED}),
    ]


def _check(quantization: str) -> None:
    if quantization not in VLLM_SCHEMES:
        raise ValueError(f"unknown FP8 quantization {quantization!r} (one of {', '.join(QUANTIZATIONS)})")


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn, round to nearest even, saturated at +-448 (the conversion vLLM's kernels use)."""
    return np.clip(x.astype(np.float32), -E4M3_MAX, E4M3_MAX).astype(E4M3)


def quantize_per_tensor(w: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """One scale for the whole matrix: (e4m3 weights, fp32 scale); dequantized = q * scale."""
    x = np.asarray(w, np.float32)
    scale = np.float32(np.abs(x).max(initial=0.0)) / np.float32(E4M3_MAX)
    inv = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
    return to_e4m3(x * inv), np.float32(scale)


def quantize_per_block(
    w: np.ndarray, block: tuple[int, int] = BLOCK, *, cuda: bool = False, ue8m0: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """One scale per block of a 2-D matrix (edge blocks zero-padded): (e4m3 weights, fp32 scales of shape
    [ceil(rows / block rows), ceil(cols / block cols)]); dequantized = q * the block's scale.

    vLLM casts per block in PyTorch (`per_block_cast_to_fp8`), and two things differ on a GPU, both found on an
    H200 (docs/fp8.md):
    - `cuda`: the scale is amax * float32(1 / 448), not amax / 448: ATen's CUDA division by a host scalar
      multiplies by its reciprocal, which can land one ulp away, and a code one step away with it.
    - `ue8m0`: DeepGEMM's linear kernel (vLLM's default on Hopper and Blackwell) casts again: it dequantizes the
      first cast and quantizes that with each block's scale rounded up to a power of two."""
    x = np.asarray(w, np.float32)
    if x.ndim != 2:
        raise ValueError(f"per-block FP8 quantizes 2-D matrices, got shape {x.shape}")
    q, scale = _cast_blocks(x, block, cuda, pow2=False)
    if ue8m0:
        q, scale = _cast_blocks(dequantize(q, scale, block), block, cuda, pow2=True)
    return q, scale


def _cast_blocks(
    x: np.ndarray, block: tuple[int, int], cuda: bool, pow2: bool
) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's `per_block_cast_to_fp8` of a 2-D float32 matrix; `pow2`: its `use_ue8m0=True` (each scale
    rounded up to a power of two)."""
    (m, n), (bm, bn) = x.shape, block
    pm, pn = -(-m // bm) * bm, -(-n // bn) * bn
    padded = np.zeros((pm, pn), np.float32)
    padded[:m, :n] = x
    view = padded.reshape(pm // bm, bm, pn // bn, bn)
    amax = np.maximum(np.abs(view).max(axis=(1, 3), keepdims=True), np.float32(_BLOCK_AMAX_FLOOR))
    if cuda:
        scale = (amax * (np.float32(1.0) / np.float32(E4M3_MAX))).astype(np.float32)
    else:
        scale = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    if pow2:
        scale = np.power(np.float32(2.0), np.ceil(np.log2(scale))).astype(np.float32)
    q = to_e4m3(view * (np.float32(1.0) / scale)).reshape(pm, pn)[:m, :n]
    return q, scale.reshape(pm // bm, pn // bn)


def dequantize(
    q: np.ndarray, scale: np.ndarray | np.float32, block: tuple[int, int] | None = None
) -> np.ndarray:
    """Back to fp32: a scalar scale for per-tensor, a [row blocks, column blocks] grid with `block`."""
    x = np.asarray(q).astype(np.float32)
    s = np.asarray(scale, np.float32)
    if block is None or s.size == 1:
        return x * s.reshape(())
    bm, bn = block
    grid = np.repeat(np.repeat(s, bm, axis=0), bn, axis=1)[: x.shape[0], : x.shape[1]]
    return x * grid


def quantize(
    w: np.ndarray, quantization: str, *, cuda: bool = False, ue8m0: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 weights, scales) for one of QUANTIZATIONS; a 3-D stack (experts) is quantized matrix by matrix.
    `cuda` and `ue8m0` are quantize_per_block's (per-tensor scales come from vLLM's own CUDA kernel, which
    divides exactly: the H200 served them bit for bit)."""
    _check(quantization)
    x = np.asarray(w, np.float32)
    if x.ndim == 3:
        parts = [quantize(m, quantization, cuda=cuda, ue8m0=ue8m0) for m in x]
        return np.stack([p[0] for p in parts]), np.stack([np.asarray(p[1]) for p in parts])
    if quantization == "fp8":
        if ue8m0:
            raise ValueError("power-of-two (ue8m0) scales exist only for fp8_per_block")
        q, s = quantize_per_tensor(x)
        return q, np.asarray(s)
    return quantize_per_block(x, cuda=cuda, ue8m0=ue8m0)


def fused_hf_weights(tensors: Mapping[str, np.ndarray], layer: int, prefix: str = "model.layers") -> dict:
    """The matrices vLLM quantizes for one decoder layer, built from HF tensors the way vLLM fuses them:
    qkv_proj = [q; k; v], gate_up_proj = [gate; up], o_proj, down_proj (dense MLP), and for a Qwen3-MoE layer
    experts.w13 = [gate_e; up_e] and experts.w2 = down_e stacked over experts. Keys are vLLM's module names."""
    p = f"{prefix}.{layer}"
    out: dict[str, np.ndarray] = {}
    a = f"{p}.self_attn"
    if f"{a}.q_proj.weight" in tensors:
        out[f"{a}.qkv_proj"] = np.concatenate([tensors[f"{a}.{k}_proj.weight"] for k in "qkv"], axis=0)
        out[f"{a}.o_proj"] = np.asarray(tensors[f"{a}.o_proj.weight"])
    m = f"{p}.mlp"
    if f"{m}.gate_proj.weight" in tensors:
        out[f"{m}.gate_up_proj"] = np.concatenate(
            [tensors[f"{m}.gate_proj.weight"], tensors[f"{m}.up_proj.weight"]]
        )
        out[f"{m}.down_proj"] = np.asarray(tensors[f"{m}.down_proj.weight"])
    experts = sorted(
        int(k.split(".")[-3])
        for k in tensors
        if k.startswith(f"{m}.experts.") and k.endswith(".gate_proj.weight")
    )
    if experts:
        e = f"{m}.experts"
        out[f"{e}.w13"] = np.stack(
            [
                np.concatenate([tensors[f"{e}.{i}.gate_proj.weight"], tensors[f"{e}.{i}.up_proj.weight"]])
                for i in experts
            ]
        )
        out[f"{e}.w2"] = np.stack([tensors[f"{e}.{i}.down_proj.weight"] for i in experts])
    return out


def compare_served(
    served_q: np.ndarray,
    served_scale: np.ndarray,
    reference: np.ndarray,
    quantization: str,
    *,
    cuda: bool = False,
) -> dict[str, float]:
    """How closely a served FP8 matrix (or expert stack) and its scales match the quantization of `reference`
    (the bf16 weights sent, as float32); `cuda`: served by a GPU (quantize_per_block). The served weight may be
    stored transposed (vLLM keeps a per-tensor linear weight as [in, out]); it is matched by shape. Per-block
    scales that are all powers of two are compared with the power-of-two cast (`ue8m0`, reported as 1.0):
    which layers DeepGEMM takes is vLLM's choice, by shape and GPU. Returns the share of e4m3 codes equal,
    the largest difference in e4m3 steps (codes are ordered like integers within a sign), the largest relative
    scale difference and the largest dequantized difference relative to the weights' largest magnitude."""
    s = np.asarray(served_scale, np.float32)
    ue8m0 = quantization == "fp8_per_block" and s.size > 0 and bool(np.all(np.frexp(s)[0] == 0.5))
    ref_q, ref_s = quantize(reference, quantization, cuda=cuda, ue8m0=ue8m0)
    q = np.asarray(served_q)
    if q.shape != ref_q.shape and q.shape == ref_q.swapaxes(-1, -2).shape:
        q = q.swapaxes(-1, -2)
    if q.shape != ref_q.shape:
        raise ValueError(
            f"served weight shape {q.shape} is not the reference's {ref_q.shape} (or its transpose)"
        )
    if ref_s.size == 1 and s.size > 1 and np.all(s == s.reshape(-1)[0]):
        s = s.reshape(-1)[:1]  # a kernel may widen a per-tensor scale to one per output channel, all equal
    if s.size == ref_s.size and s.shape != ref_s.shape:
        s = (
            s.reshape(ref_s.shape)
            if s.ndim <= 1 or ref_s.ndim <= 1
            else s.swapaxes(-1, -2).reshape(ref_s.shape)
        )
    if s.shape != ref_s.shape:
        raise ValueError(f"served scale shape {s.shape} is not the reference's {ref_s.shape}")
    a, b = q.view(np.uint8).astype(np.int16), ref_q.view(np.uint8).astype(np.int16)
    steps = np.abs((a & 0x7F) - (b & 0x7F)) + 256 * ((a ^ b) & 0x80 != 0) * ((a | b) & 0x7F != 0)
    block = BLOCK if quantization == "fp8_per_block" else None
    deq = _deq(q, s, block)
    ref = _deq(ref_q, ref_s, block)
    peak = float(np.abs(np.asarray(reference, np.float32)).max()) or 1.0
    return {
        "codes_equal": float((a == b).mean()),
        "ue8m0": float(ue8m0),
        "max_code_steps": float(steps.max(initial=0)),
        "scale_rel_err": float(np.abs(s - ref_s).max() / max(float(np.abs(ref_s).max()), 1e-30)),
        "dequant_rel_err": float(np.abs(deq - ref).max() / peak),
        # what FP8 itself loses: the reference's dequantized weights against the weights sent
        "fp8_rel_err": float(np.abs(ref - np.asarray(reference, np.float32)).max() / peak),
    }


def decode_param(t: Mapping) -> np.ndarray:
    """One tensor of a /weights_read answer ({dtype, shape, data: base64}) as a numpy array."""
    import base64

    dtype = _DTYPES.get(t["dtype"]) or np.dtype(t["dtype"])
    return np.frombuffer(base64.b64decode(t["data"]), dtype=dtype).reshape(t["shape"])


_DTYPES = {"float8_e4m3fn": E4M3, "bfloat16": ml_dtypes.bfloat16}


def _deq(q: np.ndarray, s: np.ndarray, block: tuple[int, int] | None) -> np.ndarray:
    if q.ndim == 3:
        return np.stack([dequantize(q[i], s[i], block) for i in range(q.shape[0])])
    return dequantize(q, s, block)
