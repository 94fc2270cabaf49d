"""Orbax parameter checkpoints and the Orbax <-> HF safetensors conversion (`tools/convert_checkpoint.py`, run as
its users run it: a process started from the checkout)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from hf_variants import read_checkpoint_tensors

from primejax.models.checkpoint import restore_params, save_params
from primejax.models.config import ModelConfig
from primejax.models.hf_io import export_safetensors, load_model, param_variables
from primejax.models.transformer import init_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _values(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v[...]) for k, v in param_variables(model).items()}


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.convert_checkpoint", *args], cwd=REPO, capture_output=True, text=True
    )


def test_orbax_to_safetensors_to_orbax_is_exact(hf_model_dir, tmp_path):
    """What the tool's to-hf and to-orbax do, in process: restore, export, load, save."""
    model_dir, _ = hf_model_dir("qwen3_untied")
    cfg = ModelConfig.from_model_dir(model_dir)
    model = init_model(cfg, None, seed=7)  # random weights, unlike the HF checkpoint's
    save_params(tmp_path / "a", model)
    (tmp_path / "hf").mkdir()
    export_safetensors(
        restore_params(tmp_path / "a", cfg), cfg, tmp_path / "hf", dtype=None, src_dir=model_dir
    )
    save_params(tmp_path / "b", load_model(tmp_path / "hf", param_dtype="float32")[0])
    restored = restore_params(tmp_path / "b", cfg)
    want, got = _values(model), _values(restored)
    assert sorted(want) == sorted(got)
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    # the architecture dir's generation config travels with the weights
    assert (tmp_path / "hf" / "generation_config.json").is_file()


def test_restore_into_state_template_and_bf16_checkpoint(hf_model_dir, tmp_path):
    model_dir, _ = hf_model_dir("qwen3_tied")
    cfg = ModelConfig.from_model_dir(model_dir, param_dtype="bfloat16")
    model = init_model(cfg, None, seed=1)
    save_params(tmp_path / "ck", model)
    from flax import nnx

    state = restore_params(tmp_path / "ck", nnx.state(model, nnx.Param))
    assert isinstance(state, nnx.State)
    assert np.array_equal(np.asarray(state["embed"][...]), np.asarray(model.embed[...]))
    # the tool picks the saved dtype up from Orbax metadata
    p = _convert("to-hf", "--orbax", str(tmp_path / "ck"), "--config", str(model_dir / "config.json"),
                 "--out", str(tmp_path / "hf"), "--dtype", "keep")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert {str(t.dtype) for t in read_checkpoint_tensors(tmp_path / "hf").values()} == {"bfloat16"}


def test_cli_round_trip_hf_to_orbax_to_hf_is_bit_identical(hf_model_dir, tmp_path):
    model_dir, _ = hf_model_dir("llama_gqa")
    run = _convert
    p = run("to-orbax", "--hf", str(model_dir), "--out", str(tmp_path / "ck"))
    assert p.returncode == 0, p.stderr[-3000:]
    p = run(
        "to-hf",
        "--orbax",
        str(tmp_path / "ck"),
        "--config",
        str(model_dir),
        "--out",
        str(tmp_path / "hf"),
        "--dtype",
        "keep",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "wrote" in p.stdout
    src, out = read_checkpoint_tensors(model_dir), read_checkpoint_tensors(tmp_path / "hf")
    assert sorted(src) == sorted(out)
    for name in src:
        assert out[name].dtype == src[name].dtype and np.array_equal(out[name], src[name]), name
    # existing outputs are refused with a one-line error, not overwritten
    p = run("to-orbax", "--hf", str(model_dir), "--out", str(tmp_path / "ck"))
    assert p.returncode == 1 and "already exists" in p.stderr
