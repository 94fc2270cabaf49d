"""Context parallelism (models/context_parallel.py) on an emulated 8-device CPU mesh: a 4-way split of each
packed row's tokens gives the loss, fp32 gradients and trainer steps of one device, with segments that
straddle the shard boundaries; and the layout switch around attention really is in the compiled step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Extended tier (PRIMEJAX_SLOW=1): an 8-device subprocess compiling two context-parallel meshes. The default
# tier compiles the context-parallel step for a TPU slice (tests/tpu/test_tpu_aot.py) and replays MoE routing
# with rows split over 4 devices (tests/models/test_moe_mesh.py).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("context") / "result.json"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
    }
    p = subprocess.run(
        [sys.executable, str(HERE / "context_check.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


def test_rows_straddle_the_shards(result):
    assert result["straddling_segments"] >= 4  # segments crossing the 16-token boundaries of the split
    assert max(result["segments_per_row"]) >= 3  # packed rows, not one sample each


@pytest.mark.parametrize("mesh", ["fsdp2_context4", "context4_tensor2"])
def test_loss_and_gradients_equal_one_device(result, mesh):
    r = result["meshes"][mesh]
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
    assert r["grads_max_rel"] < 1e-5  # fp32: every leaf's worst element against its largest


@pytest.mark.parametrize("mesh", ["fsdp2_context4", "context4_tensor2"])
def test_trainer_steps_equal_one_device(result, mesh):
    r = result["meshes"][mesh]
    assert r["step_losses"] == pytest.approx(r["ref_step_losses"], rel=1e-5)
    assert r["step_losses"][1] < r["step_losses"][0]  # the steps really trained
    assert r["params_rel_norm"] < 1e-4


def test_attention_switches_layout_by_all_to_all(result):
    assert result["ref_all_to_all"] == 0
    for mesh in ("fsdp2_context4", "context4_tensor2"):
        assert result["meshes"][mesh]["all_to_all"] > 0, mesh
