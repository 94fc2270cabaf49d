"""Typed config sections: every section's view builds from the defaults and from each file in configs/, the
sections reject bad values naming the key, and `model.build_tiny` is honoured whole (the demo's vocabulary)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from primejax.config import Config, ConfigError, default_config, typed
from primejax.config.cli import load_config_file
from primejax.utils.sections import Section, build

ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted((ROOT / "configs").glob("*.py"))


def _sections(value: Section, path: str = ""):
    yield path, value
    for f in dataclasses.fields(value):
        child = getattr(value, f.name)
        if isinstance(child, Section):
            yield from _sections(child, f"{path}.{f.name}" if path else f.name)
        elif isinstance(child, dict):
            for name, entry in child.items():
                if isinstance(entry, Section):
                    yield from _sections(entry, f"{path}.{f.name}.{name}")


def _typed_default() -> Config:
    c = default_config()
    c.model.path = "some/model"
    return typed(c)


@pytest.mark.parametrize("source", ["default_config", *[p.name for p in CONFIG_FILES]])
def test_every_section_builds_a_typed_view(source):
    cfg = (
        _typed_default() if source == "default_config" else typed(load_config_file(ROOT / "configs" / source))
    )
    seen = dict(_sections(cfg))
    for name in (
        "run",
        "model",
        "model.build_tiny",
        "trainer",
        "trainer.optim",
        "trainer.scheduler",
        "trainer.loss",
        "trainer.checkpoint",
        "trainer.mesh",
        "orchestrator",
        "orchestrator.sampling",
        "orchestrator.algo",
        "orchestrator.filters",
        "orchestrator.buffer",
        "orchestrator.eval",
        "orchestrator.client",
        "inference",
        "monitor",
        "sft",
    ):
        assert isinstance(seen[name], Section), name
    envs = [p for p in seen if p.startswith("orchestrator.envs.") and p.count(".") == 2]
    assert envs and all(f"{p}.algo" in seen for p in envs)  # every env entry, with its algorithm block
    for path, section in seen.items():
        # each view is frozen, and rebuilding it from its own dict gives the same value
        assert build(type(section), section.to_dict(), path) == section, path
        if dataclasses.fields(section):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(section, dataclasses.fields(section)[0].name, None)


def test_sections_name_the_key_of_a_bad_value():
    tree = json.loads(_typed_default().to_json())
    tree["trainer"]["optim"]["lr"] = "fast"
    with pytest.raises(ConfigError, match=r"^trainer\.optim\.lr: must be a float"):
        build(Config, tree)
    tree["trainer"]["optim"]["lr"] = 1e-3
    tree["orchestrator"]["envs"]["reverse_text"]["wieght"] = 2.0
    with pytest.raises(ConfigError, match=r"^orchestrator\.envs\.reverse_text\.wieght: unknown key"):
        build(Config, tree)


def test_demo_builds_a_270_token_character_level_model(tmp_path):
    """configs/demo.py asks for a character-level vocabulary of 270: the model and tokenizer really have it,
    and every character of a reverse-text prompt is one token."""
    from transformers import AutoTokenizer

    from primejax.envs.registry import load_env

    cfg = typed(load_config_file(ROOT / "configs" / "demo.py"))
    tiny = cfg.model.build_tiny
    assert (tiny.tokenizer, tiny.vocab_size) == ("bytes", 270)
    model_dir = tiny.build(tmp_path / "m")
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == 270
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 270
    entry = cfg.orchestrator.envs["reverse_text"]
    env = load_env(entry.id, entry.args)
    for i in range(20):
        example = env.example(i)
        for message in example.prompt:
            text = message["content"]
            ids = tok.encode(text, add_special_tokens=False)
            assert len(ids) == len(text) and tok.decode(ids) == text, text
        rendered = tok.apply_chat_template(example.prompt, tokenize=False, add_generation_prompt=True)
        ids = tok.apply_chat_template(example.prompt, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        specials = rendered.count("<|im_start|>") + rendered.count("<|im_end|>")
        plain = rendered.replace("<|im_start|>", "").replace("<|im_end|>", "")
        assert len(ids) == specials + len(plain)
