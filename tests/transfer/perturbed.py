"""Weights to send in an update test: the base model plus noise, as the trainer would hold them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from primejax.models.hf_io import load_model, param_variables, state_to_hf_tensors


def perturbed(
    base_dir: Path, seed: int, dtype: str = "bfloat16"
) -> tuple[object, object, list[tuple[str, np.ndarray]]]:
    """Base weights + noise (in JAX, on its default device): the model and the HF tensors in `dtype` that the
    trainer's export writes for it."""
    import jax

    model, cfg = load_model(base_dir, param_dtype="float32")
    key = jax.random.key(seed)
    for i, var in enumerate(param_variables(model).values()):
        w = var[...]
        var[...] = w + max(float(w.std()), 0.1) * jax.random.normal(
            jax.random.fold_in(key, i), w.shape, w.dtype
        )
    return model, cfg, list(state_to_hf_tensors(model, cfg, dtype))
