"""Run in a subprocess by test_mesh.py with 8 emulated CPU devices (XLA flags must precede jax's start).

Usage: python mesh_check.py HF_DIR OUT_JSON. Loads the HF model on one device and on several meshes,
records the max logits difference per mesh, each parameter's sharding spec and shard shape, and whether a
sharded random init equals the single-device one.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
from flax import nnx

from primejax.models.checkpoint import restore_params, save_params
from primejax.models.hf_io import load_model, param_variables
from primejax.models.sharding import make_mesh
from primejax.models.transformer import init_model

MESHES = {
    "fsdp8": dict(fsdp=8),
    "fsdp4_tensor2": dict(fsdp=4, tensor=2),
    "data2_fsdp2_tensor2": dict(data=2, tensor=2),
}


@nnx.jit
def _logits(model, tokens, positions, segment_ids):
    return model.logits(tokens, positions, segment_ids)


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, size=(8, 32), dtype=np.int32)
    positions = np.tile(np.arange(32, dtype=np.int32), (8, 1))
    segments = np.ones((8, 32), np.int32)
    # half the rows pack two samples
    positions[::2, 12:] -= 12
    segments[::2, 12:] = 2
    return tokens, positions, segments


def _spec_entries(spec, ndim):
    entries = list(spec) + [None] * (ndim - len(spec))
    return [list(e) if isinstance(e, tuple) else e for e in entries]


def main(hf_dir: str, out_path: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    batch = _batch()
    single, cfg = load_model(hf_dir, param_dtype="float32", compute_dtype="float32")
    ref = np.asarray(_logits(single, *batch))
    result = {"meshes": {}}
    for name, sizes in MESHES.items():
        mesh = make_mesh(**sizes)
        model, _ = load_model(hf_dir, mesh=mesh, param_dtype="float32", compute_dtype="float32")
        with jax.set_mesh(mesh):
            logits = _logits(model, *batch)
        params = {}
        for pname, var in param_variables(model).items():
            arr = var[...]
            params[pname] = {
                "spec": _spec_entries(arr.sharding.spec, arr.ndim),
                "shard_shape": list(arr.addressable_shards[0].data.shape),
                "shape": list(arr.shape),
            }
        result["meshes"][name] = {
            "max_abs_diff": float(np.abs(np.asarray(logits) - ref).max()),
            "logits_spec": _spec_entries(logits.sharding.spec, 3),
            "params": params,
        }
    # Random init directly into the most mixed layout equals the single-device init, bit for bit.
    init_sharded = init_model(cfg, mesh, seed=3)
    single_values = {k: np.asarray(v[...]) for k, v in param_variables(init_model(cfg, None, seed=3)).items()}
    result["init_equal"] = all(
        np.array_equal(np.asarray(v[...]), single_values[k]) for k, v in param_variables(init_sharded).items()
    )
    result["init_specs"] = {
        k: _spec_entries(v[...].sharding.spec, v[...].ndim) for k, v in param_variables(init_sharded).items()
    }
    # Orbax: parameters saved from the data2_fsdp2_tensor2 layout restore into the fsdp8 one.
    ckpt = os.path.join(os.path.dirname(os.path.abspath(out_path)), "orbax_params")
    save_params(ckpt, model)
    fsdp8 = make_mesh(fsdp=8)
    restored = restore_params(ckpt, cfg, mesh=fsdp8)
    saved = {k: np.asarray(v[...]) for k, v in param_variables(model).items()}
    result["orbax_reshard_equal"] = all(
        np.array_equal(np.asarray(v[...]), saved[k]) for k, v in param_variables(restored).items()
    )
    result["orbax_reshard_specs"] = {
        k: _spec_entries(v[...].sharding.spec, v[...].ndim) for k, v in param_variables(restored).items()
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
