"""Session-wide fixtures shared by every test area: tiny model directories and running vLLM servers.

A vLLM server takes 25-40 s to start on our 2-core machines, so each variant starts at most once per test
session (lazily, on first use) and is always stopped at the end, by PID, even when tests fail.

Tests marked `slow` (their own servers, several processes, minutes each) form the extended tier: they are
skipped unless `PRIMEJAX_SLOW=1` is set, so the README's test command stays within CI's budget.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from primejax.inference.process import InferenceServerProcess
from primejax.inference.server import ServerSpec
from primejax.models.tiny import build_tiny_model

SERVER_STARTUP_TIMEOUT_S = 300.0
SLOW_TIER_ENV = "PRIMEJAX_SLOW"

# Opt-in (PRIMEJAX_FAST_COMPILE=1): compile the tests' XLA programs at LLVM -O0, which halves the CPU time of the
# compile-heavy tests on this machine (docs/testing.md has the figures). It changes no HLO pass (fusion,
# sharding, buffer assignment: what the tests inspect). Not the default: the one CI run with it on took over
# three times this machine's time and ran out of its budget (docs/testing.md). Set before JAX creates its CPU
# backend, so this process and every subprocess a test starts from os.environ compile the same way; tests that
# set XLA_FLAGS for a subprocess append to it. An explicit level in XLA_FLAGS wins.
FAST_COMPILE_ENV = "PRIMEJAX_FAST_COMPILE"
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if os.environ.get(FAST_COMPILE_ENV) == "1" and "--xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_XLA_FLAGS}".strip()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(SLOW_TIER_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"extended tier: set {SLOW_TIER_ENV}=1 to run")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 (tied embeddings, fp32) with its tokenizer, Qwen3's tool-call tokens included (so the
    renderers package's qwen3 renders for it). Treat as read-only."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3-tied") / "model", tied=True, seed=0, tool_tokens=True
    )


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like `tiny_model_dir` (same tokenizer) with a separate lm_head. Treat as read-only."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3-untied") / "model", tied=False, seed=1, tool_tokens=True
    )


@dataclass
class RunningServer:
    base_url: str
    model_dir: Path
    process: InferenceServerProcess
    startup_s: float

    @property
    def log_path(self) -> Path:
        return self.process.log_path


def _serve(model_dir: Path, log_dir: Path) -> Iterator[RunningServer]:
    # fp32 end to end so the server can be compared with transformers at tight tolerances.
    spec = ServerSpec(model=str(model_dir), port=free_port(), dtype="float32", max_model_len=2048)
    proc = InferenceServerProcess(spec, log_dir / "inference.log")
    try:
        proc.start()
        startup_s = proc.wait_healthy(SERVER_STARTUP_TIMEOUT_S)
        yield RunningServer(spec.base_url, Path(model_dir), proc, startup_s)
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A vLLM server (with primejax's routes) serving `tiny_model_dir`, shared by the whole session.

    Tests that change its weights must restore them (`POST /reload_weights`) before they finish.
    """
    yield from _serve(tiny_model_dir, tmp_path_factory.mktemp("vllm-tied"))


@pytest.fixture(scope="session")
def vllm_server_untied(
    tiny_untied_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """Like `vllm_server`, serving `tiny_untied_model_dir`. Only extended-tier tests use it, so the default tier
    never starts it (docs/testing.md)."""
    yield from _serve(tiny_untied_model_dir, tmp_path_factory.mktemp("vllm-untied"))
