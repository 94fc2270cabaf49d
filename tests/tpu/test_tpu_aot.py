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

from primejax.models.config import ModelConfig
from primejax.trainer.aot import layout_error, recommend_meshes, resolve_mesh, rows_per_rank
from primejax.trainer.tpu_topology import libtpu_dir, parse_slice

ROOT = Path(__file__).resolve().parents[2]


def _libtpu_available() -> bool:
    code = (
        "import sys; from primejax.trainer.tpu_topology import use_libtpu; sys.exit(0 if use_libtpu() else 1)"
    )
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


def _skip_without_libtpu() -> None:
    if not _libtpu_available():
        pytest.skip(
            f"tpu-aot extra not installed (no libtpu importable or in {libtpu_dir()}): "
            "tools/install.sh installs it"
        )


def _tiny_compile(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """tools.tpu_compile of configs/debug.py's tiny model (4 heads, 2 kv heads) for a v5e 2x2 slice."""
    cmd = [
        sys.executable,
        "-m",
        "tools.tpu_compile",
        "--config",
        "configs/debug.py",
        "--topology",
        "v5e-4",
        "--json",
        str(out),
        "--config.model.path=",
        "--config.trainer.fake_data.enabled=True",
        "--config.model.compute_dtype=bfloat16",
        "--config.model.attention_impl=auto",
        "--config.model.build_tiny.num_heads=4",
        "--config.model.build_tiny.num_kv_heads=2",
        "--config.model.build_tiny.hidden_size=128",
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)


def test_tiny_trainer_step_compiles_for_tpu_v5e(tmp_path):
    _skip_without_libtpu()
    out = tmp_path / "report.json"
    # 2 kv heads over tensor=2: splash attention runs head-sharded inside shard_map, rows over fsdp=2
    proc = _tiny_compile(out, "--seq_len", "512", "--config.trainer.mesh.tensor=2")
    assert proc.returncode == 0, f"TPU AOT compile failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    (r,) = json.loads(out.read_text())["reports"]
    assert r["mesh"] == {"data": 1, "fsdp": 2, "context": 1, "tensor": 2}
    assert r["pallas_kernels"] > 0, (
        "no Pallas kernel in the compiled step: attention did not take the splash path"
    )
    assert r["flops"] > 0 and r["argument_bytes"] > 0 and r["fits"]
    # the FSDP weight gathers inside the scanned layers (primejax/trainer/hlo_collectives.py once returned {} on TPU)
    assert r["collective_bytes"].get("all-gather", 0) > 0, r["collective_bytes"]
    assert "collectives, GiB per chip per step" in proc.stdout
    assert "TPU v5 lite" in proc.stdout and "compile-time figures" in proc.stdout


def test_tiny_context_parallel_step_compiles_for_tpu_v5e(tmp_path):
    """context=2: each 512-token row split over 2 chips, 256 tokens per chip; splash takes the heads the
    all-to-all split over context (2 kv heads / 2), rows over fsdp=2."""
    _skip_without_libtpu()
    out = tmp_path / "report.json"
    proc = _tiny_compile(
        out, "--seq_len", "512", "--tokens_per_chip", "256", "--config.trainer.mesh.context=2"
    )
    assert proc.returncode == 0, f"TPU AOT compile failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    (r,) = json.loads(out.read_text())["reports"]
    assert r["mesh"] == {"data": 1, "fsdp": 2, "context": 2, "tensor": 1}
    assert r["rows"] == 2 and r["tokens_per_device"] == 256
    assert r["pallas_kernels"] > 0 and r["flops"] > 0 and r["fits"]
    assert "context2" in proc.stdout  # the table's mesh column

    bad = _tiny_compile(tmp_path / "bad.json", "--seq_len", "510", "--config.trainer.mesh.context=4")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: trainer.mesh.context=4 must divide the row length 510"
    )


def _qwen3_8b() -> ModelConfig:
    # Qwen/Qwen3-8B's config.json (huggingface.co): only the head counts matter to the mesh rules
    hf = dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu",
    )  # fmt: skip
    return ModelConfig.from_hf_config(hf)


def test_rows_per_rank_counts_context_groups():
    # 8 chips, rows of 128k tokens, 32k tokens per chip: a row over 4 chips (context=4), 2 context groups
    mesh = {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}
    assert rows_per_rank(8, mesh, 131072, 32768) == 1
    assert rows_per_rank(8, {**mesh, "fsdp": 8, "context": 1}, 131072, 32768) is None  # row on one chip
    # tensor=2 x context=2: 2 data-parallel ranks of 4 chips, each 2 rows' worth of 32k tokens per chip
    assert rows_per_rank(8, {"data": 1, "fsdp": 2, "context": 2, "tensor": 2}, 131072, 32768) == 1
    assert resolve_mesh({"data": 1, "fsdp": -1, "context": 2, "tensor": 2}, 16)["fsdp"] == 4
    with pytest.raises(ValueError, match="does not cover the slice's 8 chips"):
        resolve_mesh({"data": 1, "fsdp": -1, "context": 3, "tensor": 1}, 8)


def test_recommend_tries_fsdp_then_context_then_tensor():
    cfg = _qwen3_8b()  # 32 query heads, 8 kv heads
    order = lambda seq, tokens: [  # noqa: E731
        (m["tensor"], m["context"])
        for m in recommend_meshes(16, cfg, seq, tokens, [1, 2, 4, 8], [1, 2, 4, 8, 16])
    ]
    # a row per chip fits the tokens: no context split (as before context parallelism), FSDP then tensor
    assert order(16384, 16384) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    # 128k rows at 32k tokens per chip: a row must span 4 chips; FSDP alone cannot, context=4 first
    assert order(131072, 32768) == [(1, 4), (2, 2), (4, 1), (8, 1)]
    assert order(131072, 8192) == [(1, 16), (2, 8), (4, 4), (8, 2)]
    assert "query heads are not divisible by tensor x context = 64" in layout_error(
        cfg, {"tensor": 4, "context": 16}, 131072
    )
    assert "must divide the row length 1000" in layout_error(cfg, {"tensor": 1, "context": 16}, 1000)
