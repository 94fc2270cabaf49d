"""The trainer step compiles for a TPU slice on this CPU host (ahead of time, through libtpu).

CI installs libtpu into <venv>/tpu-aot (tools/install.sh, the `tpu-aot` extra); without it the compile test
skips and says so. A change that breaks TPU lowering (a kernel, a sharding, an op XLA:TPU rejects) fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.tpu_topology import libtpu_dir, parse_slice

ROOT = Path(__file__).resolve().parents[2]


def _libtpu_available() -> bool:
    code = "import sys; from tools.tpu_topology import use_libtpu; sys.exit(0 if use_libtpu() else 1)"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), timeout=120).returncode == 0


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )


def test_slice_names():
    s = parse_slice("v5p-16")  # v5p names count TensorCores: 8 chips
    assert (s.topology, s.chips, s.chip.device_kind) == ("v5p:2x2x2", 8, "TPU v5")
    assert parse_slice("v5litepod-16").topology == "v5e:4x4"
    assert parse_slice("v6e-8").topology == "v6e:2x4"
    assert parse_slice("v5e:2x2").chips == 4
    for bad in ("v5p-3", "v9-8", "tpu"):
        with pytest.raises(ValueError, match="--topology"):
            parse_slice(bad)


def test_tiny_trainer_step_compiles_for_tpu_v5e(tmp_path):
    if not _libtpu_available():
        pytest.skip(
            f"tpu-aot extra not installed (no libtpu importable or in {libtpu_dir()}): "
            "tools/install.sh installs it"
        )
    out = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "tools.tpu_compile",
        "--config",
        "configs/debug.py",
        "--topology",
        "v5e-4",
        "--seq_len",
        "512",
        "--json",
        str(out),
        "--config.model.path=",
        "--config.trainer.fake_data.enabled=True",
        "--config.model.compute_dtype=bfloat16",
        "--config.model.attention_impl=auto",
        # 2 kv heads over tensor=2: splash attention runs head-sharded inside shard_map, rows over fsdp=2
        "--config.model.build_tiny.num_heads=4",
        "--config.model.build_tiny.num_kv_heads=2",
        "--config.model.build_tiny.hidden_size=128",
        "--config.trainer.mesh.tensor=2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"TPU AOT compile failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    (r,) = json.loads(out.read_text())["reports"]
    assert r["mesh"] == {"data": 1, "fsdp": 2, "context": 1, "tensor": 2}
    assert r["pallas_kernels"] > 0, (
        "no Pallas kernel in the compiled step: attention did not take the splash path"
    )
    assert r["flops"] > 0 and r["argument_bytes"] > 0 and r["fits"]
    assert "TPU v5 lite" in proc.stdout and "compile-time figures" in proc.stdout
