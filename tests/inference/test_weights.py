"""Weight-directory validation from safetensors headers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from primejax.models.tiny import build_tiny_model
from primejax.transports.weights.validate import (
    WeightDirError,
    WeightDirValidator,
    read_safetensors_header,
    version_from_dir,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("w") / "base", tied=True)


def _copy(base, tmp_path):
    d = tmp_path / "cand"
    shutil.copytree(base, d)
    return d, next(d.glob("*.safetensors"))


def test_identical_checkpoint_and_bf16_cast_pass(base, tmp_path):
    v = WeightDirValidator(base)
    v(base)
    d, f = _copy(base, tmp_path)
    import torch
    from safetensors.torch import load_file as tload
    from safetensors.torch import save_file as tsave

    tsave({k: t.to(torch.bfloat16) for k, t in tload(str(f)).items()}, str(f))
    v(d)  # dtype may differ


def test_extra_lm_head_is_tolerated_for_tied_models(base, tmp_path):
    d, f = _copy(base, tmp_path)
    t = load_file(str(f))
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    save_file(t, str(f))
    WeightDirValidator(base)(d)


@pytest.mark.parametrize(
    "defect",
    [
        "missing_tensor",
        "extra_tensor",
        "shape",
        "truncated",
        "garbage",
        "no_config",
        "bad_config",
        "no_safetensors",
    ],
)
def test_defects_are_rejected_with_a_message(base, tmp_path, defect):
    d, f = _copy(base, tmp_path)
    t = load_file(str(f))
    if defect == "missing_tensor":
        t.pop("model.norm.weight")
        save_file(t, str(f))
    elif defect == "extra_tensor":
        t["model.layers.9.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)
        save_file(t, str(f))
    elif defect == "shape":
        t["model.norm.weight"] = np.zeros((3,), np.float32)
        save_file(t, str(f))
    elif defect == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
    elif defect == "garbage":
        f.write_bytes(b"\xff" * 64)
    elif defect == "no_config":
        (d / "config.json").unlink()
    elif defect == "bad_config":
        (d / "config.json").write_text("{not json")
    elif defect == "no_safetensors":
        f.unlink()
    with pytest.raises(WeightDirError) as e:
        WeightDirValidator(base)(d)
    assert str(d) in str(e.value) or f.name in str(e.value)


def test_header_reader_reports_shapes(base):
    h = read_safetensors_header(next(base.glob("*.safetensors")))
    cfg = json.loads((base / "config.json").read_text())
    assert h["model.embed_tokens.weight"].shape == (cfg["vocab_size"], cfg["hidden_size"])


@pytest.mark.parametrize(
    "path,version",
    [
        ("/run/broadcasts/step_12", 12),
        ("/run/broadcasts/step_3/", 3),
        ("step_0", 0),
        ("/x/step_3a", None),
        ("/x/mystep_3", None),
        ("/x/y", None),
    ],
)
def test_version_from_dir(path, version):
    assert version_from_dir(path) == version
