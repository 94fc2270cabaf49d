"""Multi-host training, emulated: two trainer processes on CPU (2 devices each, jax.distributed over gloo) train
on their rank files and must produce what one process with 4 devices produces from the same rows.

This is the multi-node recipe of the README on one machine: per-process batch shards, the cross-process
gradient all-reduce, the weight export (every parameter is sharded over both processes, so it must be
gathered before process 0 writes it), Orbax checkpoints written by both, and metrics written once.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from primejax.config import default_config, lock, to_json, validate
from primejax.contracts.batch import PackedBatch, pack_samples, step_dir, write_batch
from primejax.models.tiny import build_tiny_model
from primejax.trainer.checkpoint import complete_steps
from primejax.transports.weights.filesystem.broadcast import broadcast_dir, stable_steps
from primejax.utils.monitor import read_jsonl

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
TIMEOUT_S = 600  # a deadline for a hang, not a speed check: loaded 2-core machines need minutes


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp: Path, model_dir: Path, name: str) -> Path:
    c = default_config()
    c.run.output_dir, c.run.name, c.run.max_steps = str(tmp / "runs"), name, STEPS
    c.model.path = str(model_dir)
    c.model.compute_dtype = "float32"
    c.orchestrator.async_level = 1
    t = c.trainer
    t.optim.lr = 1e-2
    t.micro_batch_size = 1  # one row per device and micro-batch: 2 micro-batches of 4 rows
    t.logprob_chunk_size = 16
    t.batch_timeout_s = 5.0
    t.broadcast.dtype = "float32"
    t.broadcast.max_shard_mb = 0.05  # several safetensors files, so that both processes write some
    t.checkpoint.interval = 2
    t.checkpoint.async_save = False
    c.monitor.tensorboard = False
    path = tmp / f"{name}.json"
    path.write_text(to_json(lock(validate(c))))
    return path


def _write_rollouts(run: Path, make_samples, vocab: int, num_shards: int) -> None:
    """The same 8 rows per step, as one file or as two rank files of 4 (rank 0 = the first four)."""
    for step in range(1, STEPS + 1):
        samples = make_samples(200 + step, 12, max_len=20)
        for s in samples:
            s.token_ids = [t % vocab for t in s.token_ids]
        (whole,) = pack_samples(samples, seq_len=32, pad_rows_to_multiple=8)
        whole = whole.pad_rows(8)
        arrays = whole.arrays()
        for rank in range(num_shards):
            rows = slice(rank * 8 // num_shards, (rank + 1) * 8 // num_shards)
            part = PackedBatch.empty(8 // num_shards, 32)
            for k, v in arrays.items():
                getattr(part, k)[:] = v[rows]
            part.meta = dict(whole.meta)
            write_batch(step_dir(run, step), rank, part)


def _trainers(config: Path, processes: int, *overrides: str) -> list[subprocess.CompletedProcess]:
    devices = 4 // processes
    port = _free_port()
    procs = []
    for pid in range(processes):
        env = dict(
            os.environ,
            XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}",
            JAX_PLATFORMS="cpu",
        )
        if processes > 1:
            env.update(
                PRIMEJAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                PRIMEJAX_NUM_PROCESSES=str(processes),
                PRIMEJAX_PROCESS_ID=str(pid),
            )
        cmd = [sys.executable, "-m", "primejax.trainer", "--config", str(config), *overrides]
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    out = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, make_samples):
    tmp = tmp_path_factory.mktemp("multiprocess")
    model_dir = build_tiny_model(
        tmp / "model",
        tied=True,
        hidden_size=32,
        head_dim=32,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        seed=5,
    )
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    results = {}
    for name, processes in (("one", 1), ("two", 2)):
        config = _config(tmp, model_dir, name)
        run = tmp / "runs" / name
        _write_rollouts(run, make_samples, vocab, num_shards=processes)
        results[name] = (run, _trainers(config, processes))
    return results


def test_every_process_exits_cleanly(runs):
    for name, (_, procs) in runs.items():
        for p in procs:
            assert p.returncode == 0, f"{name}: {p.stdout[-3000:]}"


def test_two_processes_train_what_one_trains(runs):
    """Same rows, same 4 devices split over 2 processes: the exported weights match to fp32 reduction order.

    Adam divides by the gradient's own scale, so an element whose gradient is ~0 can move by a reduction-order
    difference: tolerance 1e-4 absolute, against updates of ~1e-2 per step (lr) that a wrong row order or a
    missing shard would change everywhere."""
    (one, _), (two, _) = runs["one"], runs["two"]
    assert stable_steps(two) == stable_steps(one) == [STEPS - 1, STEPS]
    a, b = _tensors(broadcast_dir(one, STEPS)), _tensors(broadcast_dir(two, STEPS))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-4, err_msg=k)
        assert np.linalg.norm(b[k] - a[k]) <= 1e-4 * np.linalg.norm(a[k]), k
    base = _tensors(one.parent.parent / "model")
    assert max(float(np.abs(a[k] - base[k]).max()) for k in a) > 1e-3  # training really changed the weights


def test_each_process_writes_its_share_of_the_export(runs):
    """Multi-host export: the files are split between the processes (no host writes them all)."""
    (two, procs), (one, _) = runs["two"], runs["one"]
    for rank, p in enumerate(procs):
        wrote = [
            float(x)
            for x in re.findall(rf"export step {STEPS}: process {rank} wrote ([0-9.e+-]+) of", p.stdout)
        ]
        assert wrote and wrote[0] > 0, p.stdout[-2000:]
    files = sorted(f.name for f in broadcast_dir(two, STEPS).glob("*.safetensors"))
    assert len(files) >= 2 and files == sorted(
        f.name for f in broadcast_dir(one, STEPS).glob("*.safetensors")
    )


def test_metrics_once_and_checkpoints_from_both(runs):
    (one, _), (two, _) = runs["one"], runs["two"]
    rows_one, rows_two = (
        read_jsonl(one / "metrics" / "trainer.jsonl"),
        read_jsonl(two / "metrics" / "trainer.jsonl"),
    )
    assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one] == list(range(1, STEPS + 1))
    for r1, r2 in zip(rows_one, rows_two, strict=True):
        np.testing.assert_allclose(r2["loss"], r1["loss"], rtol=1e-5, atol=1e-7)
        assert r2["perf/tokens"] == r1["perf/tokens"]
    assert complete_steps(two) == complete_steps(one) == [2, 3]


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): two more processes
def test_two_processes_resume_from_their_checkpoint(runs, tmp_path):
    """Both processes restore their shards of checkpoint 2 and retrain step 3 to the same weights."""
    two, _ = runs["two"]
    before = _tensors(broadcast_dir(two, STEPS))
    config = two.parent.parent / "two.json"
    procs = _trainers(config, 2, "--config.run.resume_step=2")
    for p in procs:
        assert p.returncode == 0, p.stdout[-3000:]
    assert "resumed from checkpoint step 2" in procs[0].stdout
    after = _tensors(broadcast_dir(two, STEPS))
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
