"""Both expert-parallel modes on 8 emulated devices equal one device: logits, expert load, loss with the
auxiliary losses, and every parameter gradient (moe_mesh_check.py runs in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from moe_mesh_check import CASES

TOL = 1e-5


@pytest.fixture(scope="module")
def results(hf_model_dir, tmp_path_factory):
    model_dir, _ = hf_model_dir("qwen3_moe_e8k2_tied")
    out = tmp_path_factory.mktemp("moe_mesh") / "result.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    script = Path(__file__).with_name("moe_mesh_check.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_equals_single_device(case, results):
    r = results["cases"][case]
    assert r["logits_diff"] <= TOL and r["loss_diff"] <= TOL, r
    assert r["grad_diff"] <= TOL, f"{case}: gradients differ by {r['grad_diff']:.3e}"
    assert r["load_equal"], f"{case}: expert load differs"
    # experts split over fsdp (the `experts` rule), nothing else
    assert r["experts_spec"][:2] == [None, "fsdp"], r["experts_spec"]
    print(f"{case}: logits {r['logits_diff']:.1e} grads {r['grad_diff']:.1e}")


def test_padding_is_not_counted_in_expert_load(results):
    assert results["ref_load_total"] == 2 * (8 * 16 - 4) * 2  # layers x valid tokens x top-k
