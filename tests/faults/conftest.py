"""Fault-suite fixtures: the shared vLLM server's URL and one uninterrupted reference run to compare against."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fault_harness import MAX_STEPS, Result, final_params, launch, reload_base_weights, write_config


@dataclass
class Reference:
    result: Result
    params: dict[str, np.ndarray]


@pytest.fixture(scope="session")
def shared_server(vllm_server):
    """The session's vLLM server; every fault test leaves it on its base weights (see `_restore_base_weights`)."""
    return vllm_server


@pytest.fixture(autouse=True)
def _restore_base_weights(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "shared_server" in request.fixturenames:
        reload_base_weights(request.getfixturevalue("shared_server").base_url)


@pytest.fixture(scope="session")
def fault_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="session")
def reference(shared_server, fault_dir: Path) -> Reference:
    """An uninterrupted run with the same seed and config as every fault run."""
    config = write_config(
        fault_dir, "reference", shared_server.model_dir, base_url=shared_server.base_url, max_steps=MAX_STEPS
    )
    result = launch(config)
    reload_base_weights(shared_server.base_url)
    assert result.returncode == 0, result.output[-3000:]
    assert [r["step"] for r in result.metrics("trainer")] == list(range(1, MAX_STEPS + 1))
    return Reference(result, final_params(result.run_dir, MAX_STEPS))
