"""The family registry (models/families/): the model core names no family, and every registered family's
config.json round-trips through ModelConfig."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import primejax.models
from primejax.models.config import ModelConfig
from primejax.models.families import FAMILIES, WRAPPERS
from primejax.models.tiny import FAMILIES as TINY_FAMILIES
from primejax.models.tiny import TinyModelConfig
from primejax.utils.sections import ConfigError

MODELS = Path(primejax.models.__file__).parent


def test_core_names_no_family():
    """No module of models/ outside families/ spells a model_type in its code (comments and docstrings may):
    a family's particulars live in its own file."""
    names = set(FAMILIES) | set(WRAPPERS)
    found = []
    for path in sorted(MODELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
    # the tiny builder's defaults (models/tiny.py) are choices of a family, not branches on one
    allowed = {"tiny.py"}
    assert [f for f in found if f.split(":")[0] not in allowed] == []


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_config_round_trips(family):
    cfg = TinyModelConfig(family=family).architecture()
    hf = cfg.to_hf_config()
    assert hf["model_type"] == family and hf["architectures"] == [FAMILIES[family].architecture]
    assert ModelConfig.from_hf_config(hf) == cfg


def test_tiny_section_refuses_sizes_its_family_cannot_build():
    with pytest.raises(ConfigError, match="glm4_moe at these sizes: n_group=2 must divide num_experts=5"):
        TinyModelConfig(family="glm4_moe", num_experts=5, num_experts_per_tok=2)
    TinyModelConfig(family="qwen3_moe", num_experts=5, num_experts_per_tok=2)  # one group: any number
