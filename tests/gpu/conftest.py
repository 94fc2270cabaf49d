"""The GPU tier: real GPU vLLM servers and the trainer on NVIDIA GPUs. Skipped where no GPU is visible.

Run on a GPU node (docs/gpu.md): `python -m pytest tests/gpu -q`; gpu_env.py says which GPU does what.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from gpu_env import GPUS, SERVER_GPU  # tests/gpu/gpu_env.py (pytest puts this folder on sys.path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPUS:
        return
    skip = pytest.mark.skip(reason="GPU tier: no NVIDIA GPU visible")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Qwen3 (fp32 on disk, served in bf16) with head_dim 128 (FlashAttention's sizes), untied."""
    from primejax.models.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("gpu-qwen3") / "model",
        tied=False,
        seed=3,
        hidden_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        intermediate_size=512,
    )


@pytest.fixture(scope="session")
def gpu_server(gpu_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A vLLM server on SERVER_GPU (bf16, CUDA graphs off), shared by the session; tests restore its weights."""
    from primejax.inference.process import InferenceServerProcess
    from primejax.inference.server import ServerSpec, free_port

    spec = ServerSpec(
        model=str(gpu_model_dir),
        port=free_port(),
        dtype="bfloat16",
        max_model_len=1024,
        devices=SERVER_GPU,
        gpu_memory_utilization=0.3,
    )
    proc = InferenceServerProcess(spec, tmp_path_factory.mktemp("gpu-server") / "inference.log")
    try:
        proc.start()
        startup_s = proc.wait_healthy(600)
        print(f"\nGPU vLLM server healthy in {startup_s:.0f} s (log {proc.log_path})")
        yield SimpleNamespace(
            base_url=spec.base_url, model_dir=Path(gpu_model_dir), process=proc, startup_s=startup_s
        )
    finally:
        proc.stop()
