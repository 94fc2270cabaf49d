"""The offline tiny-model builder: loadable by transformers, deterministic, tokenizer covers our envs."""

from __future__ import annotations

import dataclasses
import json
import string

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from primejax.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return build_tiny_model(root / "a", seed=5), build_tiny_model(root / "b", seed=5)


def test_same_seed_gives_identical_files(built):
    a, b = built
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tokenizer_round_trips_every_builtin_env_string(built):
    tok = AutoTokenizer.from_pretrained(str(built[0]))
    samples = [
        string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation + " \n\t",
        "Reverse the text: hello world!",
        "dlrow olleh",
        "apple banana cherry",
        "(12 + 30) * 4 - 7 / 2 = ?",
        "<reversed_text>abc</reversed_text>",
        "héllo ünïcode ✓",
    ]
    for s in samples:
        assert tok.decode(tok(s)["input_ids"]) == s
    assert 300 <= len(tok) <= 512


def test_chat_template_special_tokens_and_generation_config(built):
    d = built[0]
    tok = AutoTokenizer.from_pretrained(str(d))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("<think>x</think><|im_end|>")["input_ids"]
    # think tags survive skip_special_tokens (reasoning parsers read them); <|im_end|> does not
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>"
    gen = json.loads((d / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


@pytest.mark.parametrize("family,tied", [("qwen3", False), ("llama", True), ("llama", False)])
def test_variants_load_in_transformers(tmp_path, family, tied):
    d = build_tiny_model(tmp_path / "m", family=family, tied=tied)
    model = AutoModelForCausalLM.from_pretrained(str(d))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["tie_word_embeddings"] == tied and model.dtype == torch.float32
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, len(AutoTokenizer.from_pretrained(str(d)))) and torch.isfinite(out).all()


def test_head_dim_below_vllm_cpu_minimum_is_refused(tmp_path):
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_model(tmp_path / "m", head_dim=16)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_build_tiny_architecture_is_the_built_models_config(tmp_path, family):
    """`model.build_tiny.architecture()` (fake-data runs, AOT compiles) describes exactly the model `build()`
    writes: the same ModelConfig as reading its config.json back, RoPE base included."""
    from primejax.models.config import ModelConfig
    from primejax.models.tiny import TinyModelConfig

    tiny = TinyModelConfig(family=family, tied=False)
    built = ModelConfig.from_model_dir(tiny.build(tmp_path / "m"))
    described = tiny.architecture(max_positions=built.max_position_embeddings)
    assert dataclasses.replace(described, hf_extra=built.hf_extra) == built
