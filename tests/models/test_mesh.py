"""Same logits on 8 emulated devices under three mesh layouts, parameters sharded as the rules say.

XLA's device count is fixed when jax starts, so the check runs in a subprocess (mesh_check.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from primejax.models.sharding import SHARDING_RULES, logical_to_spec

# Hand-written expectations for the qwen3_untied test model (D=64, H=4, K=2, Dh=32, F=128, V=512).
_TP = {  # fsdp and tensor both > 1
    "embed": ["tensor", "fsdp"],
    "lm_head": ["fsdp", "tensor"],
    "final_norm": [None],
    "layers.attn_norm": [None, None],
    "layers.mlp_norm": [None, None],
    "layers.q_norm": [None, None],
    "layers.k_norm": [None, None],
    "layers.q_proj": [None, "fsdp", "tensor", None],
    "layers.k_proj": [None, "fsdp", "tensor", None],
    "layers.v_proj": [None, "fsdp", "tensor", None],
    "layers.o_proj": [None, "tensor", None, "fsdp"],
    "layers.gate_proj": [None, "fsdp", "tensor"],
    "layers.up_proj": [None, "fsdp", "tensor"],
    "layers.down_proj": [None, "tensor", "fsdp"],
}
# tensor=1: the tensor entries disappear
_FSDP_ONLY = {k: [None if e == "tensor" else e for e in v] for k, v in _TP.items()}
EXPECTED = {
    "fsdp8": (_FSDP_ONLY, {"fsdp": 8, "tensor": 1}, ["fsdp", None, None]),
    "fsdp4_tensor2": (_TP, {"fsdp": 4, "tensor": 2}, ["fsdp", None, "tensor"]),
    "data2_fsdp2_tensor2": (_TP, {"fsdp": 2, "tensor": 2}, [["data", "fsdp"], None, "tensor"]),
}
TOL = 1e-5  # fp32; sharded reductions sum in a different order


@pytest.fixture(scope="module")
def mesh_results(hf_model_dir, tmp_path_factory):
    model_dir, _ = hf_model_dir("qwen3_untied")
    out = tmp_path_factory.mktemp("mesh") / "result.json"
    env = dict(
        os.environ,
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
    )
    script = Path(__file__).with_name("mesh_check.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mesh_name", list(EXPECTED))
def test_same_logits_and_rule_shardings_on_mesh(mesh_name, mesh_results):
    res = mesh_results["meshes"][mesh_name]
    specs, sizes, logits_spec = EXPECTED[mesh_name]
    assert res["max_abs_diff"] <= TOL, (
        f"{mesh_name}: logits differ from one device by {res['max_abs_diff']:.3e}"
    )
    print(f"{mesh_name}: max abs logits diff vs one device = {res['max_abs_diff']:.2e}")
    assert res["logits_spec"] == logits_spec
    assert {k: v["spec"] for k, v in res["params"].items()} == specs
    for name, p in res["params"].items():
        want = [
            n // (sizes["fsdp"] if e == "fsdp" else sizes["tensor"] if e == "tensor" else 1)
            for n, e in zip(p["shape"], p["spec"], strict=True)
        ]
        assert p["shard_shape"] == want, f"{name}: shard {p['shard_shape']} != {want}"


def test_sharded_random_init_is_bit_identical_to_single_device(mesh_results):
    assert mesh_results["init_equal"]
    assert mesh_results["init_specs"] == _TP


def test_orbax_restore_reshards_to_another_mesh(mesh_results):
    assert mesh_results["orbax_reshard_equal"]
    assert mesh_results["orbax_reshard_specs"] == _FSDP_ONLY


def test_rules_refuse_two_logical_axes_on_one_mesh_axis():
    with pytest.raises(ValueError, match="both map to mesh axis 'tensor'"):
        logical_to_spec(("q_heads", "mlp"))
    with pytest.raises(KeyError, match="no entry"):
        logical_to_spec(("not_an_axis",))
    assert SHARDING_RULES["embed"] == ("fsdp", "context")
