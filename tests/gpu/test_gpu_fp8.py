"""FP8 servers on a GPU: after the first load and after every kind of weight update (filesystem, collective, LoRA
merged), the e4m3 weights and scales a server serves are the quantization of the bf16 weights it was sent; LoRA
adapters served over an FP8 base.

One server per scheme (`fp8` per-tensor, `fp8_per_block` 128 x 128) serving a tiny Qwen3-MoE, so one layer holds
both kinds of quantized weights vLLM has: linear (fused q/k/v, o) and fused experts (w13, w2). The served tensors
come back through POST /weights_read and are compared with primejax.inference.fp8's numpy quantization. Adapters:
a per-tensor server with LoRA on against the JAX adapted model on the dequantized base, and the user's LoRA run
with an FP8 server beside the same run in bf16.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import ml_dtypes
import numpy as np
import pytest
from gpu_env import SERVER_GPU  # tests/gpu/gpu_env.py
from gpu_rounds import collective_round, post  # tests/gpu/gpu_rounds.py
from gpu_runs import small_run, trained_steps  # tests/gpu/gpu_runs.py

from primejax.inference import InferenceClient, fp8
from primejax.inference.admin_auth import process_token
from primejax.models.hf_io import export_safetensors, load_model
from tests.inference.fp8_model import build_fp8_moe
from tests.transfer.perturbed import perturbed

PROMPTS = ["reverse: hello world", "12 + 30 = ", "sort: cherry apple banana"]
LAYER = "model.layers.0"
READ = [f"{LAYER}.self_attn.qkv_proj.", f"{LAYER}.self_attn.o_proj.", f"{LAYER}.mlp.experts."]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fp8_moe(tmp_path_factory.mktemp("gpu-fp8-moe") / "model")


@pytest.fixture(scope="module", params=fp8.QUANTIZATIONS)
def fp8_server(request, moe_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from primejax.inference.process import InferenceServerProcess
    from primejax.inference.server import ServerSpec, free_port

    spec = ServerSpec(
        model=str(moe_dir),
        port=free_port(),
        dtype="bfloat16",
        quantization=request.param,
        max_model_len=1024,
        devices=SERVER_GPU,
        gpu_memory_utilization=0.12,
    )
    proc = InferenceServerProcess(spec, tmp_path_factory.mktemp(f"gpu-{request.param}") / "inference.log")
    try:
        proc.start()
        print(f"\n{request.param} server healthy in {proc.wait_healthy(600):.0f} s (log {proc.log_path})")
        yield request.param, spec.base_url
    finally:
        proc.stop()


def _bf16(tensors: dict) -> dict[str, np.ndarray]:
    """What a bf16 server holds of these tensors before it quantizes: each value rounded to bf16."""
    return {
        k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in tensors.items()
    }


def _disk(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _check(url: str, quant: str, sent: dict[str, np.ndarray], what: str) -> dict:
    """Every quantized matrix of layer 0 as served vs the quantization of `sent` (HF names, float32 values)."""
    r = post(url, "/weights_read", {"prefixes": READ})
    assert r.status_code == 200, r.text
    (served,) = r.json()["workers"]
    got = {n: fp8.decode_param(t) for n, t in served.items()}
    ref = fp8.fused_hf_weights(_bf16(sent), 0)
    scale = "weight_scale_inv" if quant == "fp8_per_block" else "weight_scale"
    pairs = {
        f"{LAYER}.self_attn.qkv_proj": (
            f"{LAYER}.self_attn.qkv_proj.weight",
            f"{LAYER}.self_attn.qkv_proj.{scale}",
        ),
        f"{LAYER}.self_attn.o_proj": (
            f"{LAYER}.self_attn.o_proj.weight",
            f"{LAYER}.self_attn.o_proj.{scale}",
        ),
        f"{LAYER}.mlp.experts.w13": (
            f"{LAYER}.mlp.experts.routed_experts.w13_weight",
            f"{LAYER}.mlp.experts.routed_experts.w13_{scale}",
        ),
        f"{LAYER}.mlp.experts.w2": (
            f"{LAYER}.mlp.experts.routed_experts.w2_weight",
            f"{LAYER}.mlp.experts.routed_experts.w2_{scale}",
        ),
    }
    layout = {n: (str(a.dtype), list(a.shape)) for n, a in got.items()}
    stats = {}
    for module, (w, s) in pairs.items():
        assert w in got and s in got, f"{what}: {w} / {s} not served; served {json.dumps(layout)}"
        stats[module] = fp8.compare_served(got[w], got[s], ref[module], quant, cuda=True)
    print(f"\n{quant} after {what}: {json.dumps(stats)}")
    for module, st in stats.items():
        assert st["codes_equal"] >= 0.999 and st["max_code_steps"] <= 1, (what, module, st)
        assert st["scale_rel_err"] <= 1e-6, (what, module, st)
    return stats


async def _greedy(url: str, model_dir: Path) -> list[list[float]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    async with InferenceClient(url) as c:
        outs = await asyncio.gather(
            *(c.generate(tok(p)["input_ids"], n=1, max_tokens=8, temperature=0.0) for p in PROMPTS)
        )
    return [o[0].completion_logprobs for o in outs]


def test_fp8_server_serves_the_quantization_of_every_update(fp8_server, moe_dir, tmp_path):
    import torch

    from primejax.models import lora, lora_io
    from primejax.transports.weights.collective.sender import CollectiveSender, to_torch

    quant, url = fp8_server
    base = _disk(moe_dir)
    _check(url, quant, base, "the first load")
    try:
        # 1. filesystem: the trainer's bf16 export, loaded in place (vLLM's layerwise reload re-quantizes)
        model, cfg, named = perturbed(moe_dir, seed=31)
        export_safetensors(model, cfg, tmp_path / "step_1", dtype="bfloat16", src_dir=moe_dir, tensors=named)
        r = post(url, "/update_weights", {"weight_dir": str(tmp_path / "step_1")})
        assert r.status_code == 200, r.text
        _check(url, quant, dict(named), "a filesystem update")

        # 2. collective: the same protocol the trainer's sender speaks, over gloo (one GPU: NCCL needs two)
        _, _, named2 = perturbed(moe_dir, seed=32)
        sender = CollectiveSender(
            tmp_path / "run", secret=process_token(), timeout_s=120, backend="gloo", bucket_bytes=16 * 2**20
        )
        collective_round(url, sender, tmp_path / "run", 2, [(n, to_torch(a)) for n, a in named2])
        _check(url, quant, dict(named2), "a collective update")

        # 3. LoRA merged: base + s·A·B written by the trainer's merge, as trainer.broadcast.lora='merged' sends it
        lmodel, lcfg = load_model(
            moe_dir, param_dtype="float32", lora_rank=8, lora_alpha=16.0, lora_targets=lora.DEFAULT_TARGETS
        )
        lora.fill_adapters(lmodel, seed=0)
        from flax import nnx

        params = nnx.to_pure_dict(nnx.state(lmodel))
        adapters, _ = lora.split_adapters(params)
        rng = np.random.default_rng(7)
        adapters = {
            "layers": {
                k: (
                    rng.normal(0, 0.05, np.shape(v)).astype(np.float32) if k.endswith("_b") else np.asarray(v)
                )
                for k, v in adapters["layers"].items()
            }
        }
        lora_io.export_peft(adapters, lcfg, tmp_path / "adapter")
        lora_io.merge_peft(moe_dir, tmp_path / "adapter", tmp_path / "merged", dtype="bfloat16")
        r = post(url, "/update_weights", {"weight_dir": str(tmp_path / "merged"), "version": 3})
        assert r.status_code == 200, r.text
        merged = _disk(tmp_path / "merged")
        assert not np.array_equal(
            merged[f"{LAYER}.self_attn.q_proj.weight"], base[f"{LAYER}.self_attn.q_proj.weight"]
        )
        _check(url, quant, merged, "a LoRA-merged update")
        logprobs = asyncio.run(_greedy(url, moe_dir))
        assert all(len(lp) > 0 and np.isfinite(lp).all() for lp in logprobs)
    finally:
        assert post(url, "/reload_weights").status_code == 200
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    _check(url, quant, base, "going back to the base weights")


def _dequantized_dir(model_dir: Path, out: Path) -> Path:
    """`model_dir` as a per-tensor FP8 server holds it: every matrix vLLM quantizes replaced by its e4m3 codes
    times its scale (fused the way vLLM fuses them, then split back to HF names), the rest rounded to bf16."""
    import shutil

    from safetensors.numpy import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = _bf16(_disk(model_dir))
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        for module, w in fp8.fused_hf_weights(tensors, layer).items():
            deq = fp8.dequantize(*fp8.quantize(w, "fp8"))
            if module.endswith("qkv_proj"):
                q, k, _ = np.cumsum([heads * hd, kv * hd, kv * hd])
                parts = {"q_proj": deq[:q], "k_proj": deq[q:k], "v_proj": deq[k:]}
            elif module.endswith("gate_up_proj"):
                parts = dict(zip(("gate_proj", "up_proj"), np.split(deq, 2), strict=True))
            else:
                parts = {module.rsplit(".", 1)[1]: deq}
            scope = f"{p}.self_attn" if ".self_attn." in module else f"{p}.mlp"
            tensors.update({f"{scope}.{name}.weight": v for name, v in parts.items()})
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def test_lora_adapter_on_an_fp8_base_serves_the_quantized_base_plus_the_adapter(gpu_model_dir, tmp_path):
    """A PEFT adapter (rank 8, B random) loaded into a per-tensor FP8 server with LoRA on. The server's base
    stays the quantization of the bf16 weights (LoRA's wrappers do not change what is quantized), and the
    adapter's prompt logprobs are as close to the JAX adapted model on the *dequantized* base as the base's own
    logprobs are to the JAX base model: what remains in both is the activations' FP8 cast, so the adapter is
    applied over the quantized base. A bf16 reference (the weights before quantizing) is printed beside it."""
    import jax.numpy as jnp

    from primejax.inference.process import InferenceServerProcess
    from primejax.inference.server import ServerSpec, free_port
    from primejax.models import lora, lora_io
    from tests.inference.lora_model import R, adapted, jax_logprobs, post_json, prompt_logprobs

    ref_dir = _dequantized_dir(gpu_model_dir, tmp_path / "dequantized")
    cfg, graphdef, params = adapted(ref_dir)
    adapters, _ = lora.split_adapters(params)
    lora_io.export_peft(adapters, cfg, tmp_path / "adapter", base_model=str(gpu_model_dir))
    tokens = [int(t) for t in np.random.default_rng(3).integers(10, cfg.vocab_size - 10, 48)]
    no_adapter = {
        **params,
        "layers": {k: jnp.zeros_like(v) if k.endswith("_lora_b") else v for k, v in params["layers"].items()},
    }
    want = {
        "adapter": jax_logprobs(graphdef, params, tokens),
        "base": jax_logprobs(graphdef, no_adapter, tokens),
    }
    _, bf16_graph, bf16_params = adapted(gpu_model_dir)
    unquantized = jax_logprobs(bf16_graph, bf16_params, tokens)

    spec = ServerSpec(
        model=str(gpu_model_dir),
        port=free_port(),
        dtype="bfloat16",
        quantization="fp8",
        lora_rank=R,
        max_model_len=512,
        devices=SERVER_GPU,
        gpu_memory_utilization=0.12,
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},  # /v1/load_lora_adapter, as docs/lora.md loads one
    )
    proc = InferenceServerProcess(spec, tmp_path / "inference.log")
    try:
        proc.start()
        print(f"\nfp8 + LoRA server healthy in {proc.wait_healthy(600):.0f} s (log {proc.log_path})")
        r = post(spec.base_url, "/weights_read", {"prefixes": ["model.layers.0."]})
        assert r.status_code == 200, r.text
        (served,) = r.json()["workers"]
        got = {n.replace(".base_layer", ""): fp8.decode_param(t) for n, t in served.items()}
        ref = fp8.fused_hf_weights(_bf16(_disk(gpu_model_dir)), 0)
        for module, w in ref.items():
            st = fp8.compare_served(
                got[f"{module}.weight"], got[f"{module}.weight_scale"], w, "fp8", cuda=True
            )
            assert st["codes_equal"] == 1.0 and st["scale_rel_err"] == 0.0, (module, st)
        status, text = post_json(
            f"{spec.base_url}/v1/load_lora_adapter",
            {"lora_name": "a1", "lora_path": str(tmp_path / "adapter")},
        )
        assert status == 200, text
        base_name = httpx.get(f"{spec.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        served_lp = {"adapter": prompt_logprobs(spec.base_url, "a1", tokens),
                     "base": prompt_logprobs(spec.base_url, base_name, tokens)}  # fmt: skip
    finally:
        proc.stop()
    err = {k: float(np.abs(served_lp[k] - want[k]).mean()) for k in want}
    effect = float(np.abs(served_lp["adapter"] - served_lp["base"]).mean())
    vs_bf16 = float(np.abs(served_lp["adapter"] - unquantized).mean())
    print(f"\nmean |logprob error|: adapter {err['adapter']:.4f}, base {err['base']:.4f}; "
          f"adapter vs the bf16 reference {vs_bf16:.4f}; the adapter's own effect {effect:.4f}")  # fmt: skip
    assert err["adapter"] <= 2 * err["base"] + 0.01, err
    assert effect >= 5 * err["adapter"], (effect, err)


@pytest.mark.parametrize("quantization", ["", "fp8"], ids=["bf16", "fp8"])
def test_lora_run_on_an_fp8_base(quantization, tmp_path):
    """The user's LoRA command with `inference.quantization=fp8`, the bf16 server beside it as the same-call
    baseline: 3 RL steps train with the adapter loaded into the server each step, and the step-1 mismatch KL
    (trainer vs sampler on the same weights) stays small."""
    extra = [
        "--config.model.lora.rank=16",
        "--config.model.lora.alpha=32",
        "--config.sft.warmup_lora=False",
        "--config.trainer.optim.lr=4e-4",
        *([f"--config.inference.quantization={quantization}"] if quantization else []),
    ]
    small_run(tmp_path, *extra)
    steps = trained_steps(tmp_path / "run")
    print(f"\n{quantization or 'bf16'} LoRA run: " + json.dumps([
        {k: r.get(k) for k in ("step", "loss", "mismatch_kl", "reward")} for r in steps
    ]))  # fmt: skip
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in steps)
    assert steps[0]["mismatch_kl"] < 1e-2, steps[0]
