"""Session fixtures for the model tests: tiny HF checkpoints built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from hf_variants import build_hf_model


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """variant -> (directory, torch model); built once per session on first use."""
    cache: dict[str, tuple[Path, transformers.PreTrainedModel]] = {}

    def get(variant: str):
        if variant not in cache:
            out = tmp_path_factory.mktemp(variant)
            cache[variant] = (out, build_hf_model(variant, out))
        return cache[variant]

    return get
