"""Fixtures of the orchestrator tests: the tiny tokenizer (no model weights needed for the fake-server tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from primejax.models.tiny import build_tokenizer

    out: Path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))
