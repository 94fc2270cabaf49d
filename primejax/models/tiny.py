"""Tiny random HF models for tests and demos, built offline in seconds.

There is no model hub on our machines, so every test builds its model from a config (random init) and a
small byte-level BPE tokenizer trained locally. The output is an ordinary Hugging Face directory that
transformers, vLLM and primejax's loader all read.

Byte-level BPE starts from all 256 byte symbols, so any string (including every prompt and answer of the
built-in environments) is representable; the merges only make common strings shorter.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

from primejax.models.families import FAMILIES as _REGISTRY
from primejax.models.families import Family, family_of
from primejax.utils.io import atomic_write_json
from primejax.utils.sections import ConfigError, Section, option, section

# The families the builder writes: those whose file gives a tiny shape (`Family.tiny`).
FAMILIES = tuple(t for t, f in _REGISTRY.items() if type(f).tiny is not Family.tiny)
# The RoPE base of every tiny model: written to its config.json and used by `TinyModelConfig.architecture`.
ROPE_THETA = 1_000_000.0

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
THINK_START = "<think>"
THINK_END = "</think>"
# Control tokens are "special" (skipped when decoding with skip_special_tokens); the think tags are plain
# added tokens, as in Qwen3, so they survive into the decoded text that reasoning parsers read.
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
THINK_TOKENS = [THINK_START, THINK_END]
# Qwen3's tool-call markers, plain added tokens as in Qwen3; opt-in (`tool_tokens=True`) so the default
# tokenizer, and every model built from it, stays what it was. The renderers package's Qwen3 renderer needs them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

DEFAULT_VOCAB_SIZE = 384
TOKENIZERS = ("bpe", "bytes")
# The byte tokenizer's own tokens: the 256 byte symbols, the control tokens and the think tags.
BYTES_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(THINK_TOKENS)

# Qwen-style ChatML. Content may be a string or a list of {"type": "text", "text": ...} parts (the OpenAI
# shape), which verifiers and vLLM both produce.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _builtin_corpus() -> list[str]:
    """Text resembling the built-in environments (reverse-text, alphabet-sort, arithmetic) and chat turns."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines = [
        "Reverse the text character by character. Put your answer in <reversed_text> tags.",
        "Sort the following words alphabetically. Put your answer in <alphabetical_sorted> tags.",
        "Solve the arithmetic problem. Give only the final number as the answer.",
        "You are a helpful assistant. Think step by step, then answer.",
        "the quick brown fox jumps over the lazy dog.",
        "What is the answer? The answer is: ",
        "system user assistant <reversed_text> </reversed_text> <answer> </answer>",
        letters,
        letters[::-1],
        letters.upper(),
        "0123456789 + - * / = ( ) . , ; : ! ? ' \" [ ] { } < > _ # % & @ $ ^ ~ | \\",
    ]
    for i in range(0, 26, 3):
        lines.append(" ".join(letters[i : i + 5]) + " " + letters[i : i + 5][::-1])
    for a in range(0, 100, 7):
        for b in range(1, 60, 11):
            lines.append(f"{a} + {b} = {a + b}. {a} * {b} = {a * b}. {a} - {b} = {a - b}.")
    words = ["apple", "banana", "cherry", "delta", "echo", "forest", "garden", "harbor", "island", "jungle"]
    for i in range(len(words)):
        lines.append(" ".join(words[i:] + words[:i]) + ", " + " ".join(sorted(words)))
    return lines


def build_tokenizer(
    out_dir: Path,
    *,
    vocab_size: int = 0,
    corpus: list[str] | None = None,
    kind: str = "bpe",
    tool_tokens: bool = False,
    extra_tokens: tuple[str, ...] = (),
):
    """Save an HF fast tokenizer in out_dir: a byte-level BPE trained on `corpus` (built-in if None) to
    `vocab_size` tokens (0 = 384), or `kind="bytes"`: one token per byte (so per ASCII character), no merges,
    padded with reserved special tokens up to `vocab_size` (0 = no padding, 261 tokens).

    `tool_tokens` adds Qwen3's tool-call markers after the vocabulary (the merges are unchanged);
    `extra_tokens` adds fixed strings (e.g. a prompt template's long constant lines) as plain added tokens after
    those, so a demo's tiny model reads each of them as one token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if kind == "bytes":
        if vocab_size and vocab_size < BYTES_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size={vocab_size}: a byte tokenizer has {BYTES_VOCAB_SIZE} tokens at least"
            )
        vocab = {symbol: i for i, symbol in enumerate(alphabet)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    elif kind == "bpe":
        tok = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(
            vocab_size=(vocab_size or DEFAULT_VOCAB_SIZE) - len(THINK_TOKENS),
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=alphabet,
            show_progress=False,
        )
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r} (one of {TOKENIZERS})")
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if kind == "bpe":
        tok.train_from_iterator(corpus if corpus is not None else _builtin_corpus(), trainer=trainer)
    added = THINK_TOKENS + (TOOL_TOKENS if tool_tokens else []) + list(extra_tokens)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if kind == "bytes" and vocab_size > tok.get_vocab_size():
        # Reserved ids fill the embedding up to vocab_size; special, so they never appear in decoded text.
        reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - tok.get_vocab_size())]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    out_dir: str | Path,
    *,
    family: str = "qwen3",
    tied: bool = True,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tokenizer: str = "bpe",
    seed: int = 0,
    corpus: list[str] | None = None,
    init_std: float = 0.02,
    max_position_embeddings: int = 4096,
    tool_tokens: bool = False,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    mlp_only_layers: tuple[int, ...] = (),
    extra_tokens: tuple[str, ...] = (),
) -> Path:
    """Write a random-init tiny model of `family` (fp32 safetensors) plus tokenizer to `out_dir`.

    The family's file shapes its config.json from these arguments (`Family.tiny` in models/families/: e.g.
    deepseek_v3's latent widths, glm4_moe's groups and shared expert, qwen3_5's layer pattern); the MoE
    arguments apply to the MoE families. Routers are drawn wider (std 0.5) than the rest so routing is decided
    clearly, not by near-ties, and a sigmoid router's correction bias is random (std 0.1; HF starts it at 0).

    `tokenizer` "bpe" trains a byte-level BPE of `vocab_size` tokens (default 384); "bytes" is character-level
    (one token per byte) padded to `vocab_size`. The model's vocab equals the tokenizer's size, so every id the
    model can sample decodes. head_dim must be >= 32 (vLLM's CPU attention kernels).
    Deterministic given `seed` and `corpus`. `tool_tokens` adds Qwen3's `<tool_call>`/`<tool_response>` markers;
    `extra_tokens` adds fixed strings as single tokens (see `build_tokenizer`).
    """
    import torch
    import transformers

    if head_dim < 32:
        raise ValueError(f"head_dim={head_dim}: vLLM's CPU attention needs head_dim >= 32")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(
        out,
        vocab_size=vocab_size or 0,
        corpus=corpus,
        kind=tokenizer,
        tool_tokens=tool_tokens,
        extra_tokens=extra_tokens,
    )
    n_vocab = len(tok)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + THINK_TOKENS}

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (expected one of {FAMILIES})")
    shape = dict(
        vocab_size=n_vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        initializer_range=init_std,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        rope_theta=ROPE_THETA,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        mlp_only_layers=tuple(mlp_only_layers),
    )
    hf = family_of(family).tiny(shape)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    model_cls = getattr(transformers, family_of(family).architecture)

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    if family_of(family).moe:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.5)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.1)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
    )
    model.save_pretrained(str(out))
    # Written last: its presence marks a complete build (fixtures that cache model dirs check it).
    atomic_write_json(
        out / "primejax_tiny.json",
        {
            "family": family,
            "tied": tied,
            "seed": seed,
            "tokenizer": tokenizer,
            "vocab_size": n_vocab,
            "tool_tokens": tool_tokens,
        },
    )
    return out


# The tiny Qwen3-MoE that the vLLM-facing MoE tests (routed-expert capture, weight updates) and
# mismatch-KL measurement of docs/moe.md build: heads wide enough for vLLM's CPU kernels, 8 experts top-2, untied.
TINY_MOE: MappingProxyType[str, Any] = MappingProxyType(
    dict(
        family="qwen3_moe",
        tied=False,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        seed=3,
    )
)


def build_tiny_moe(out_dir: str | Path, **overrides: Any) -> Path:
    """`build_tiny_model` with the `TINY_MOE` arguments, any of them (or others) replaced by `overrides`."""
    return build_tiny_model(out_dir, **{**TINY_MOE, **overrides})


@section
class TinyModelConfig(Section):
    """`model.build_tiny`: a tiny random model + tokenizer built at `model.path` when it is missing (offline)."""

    enabled: bool = option(False, "build the model when model.path has no config.json")
    family: str = option("qwen3", "architecture", choices=FAMILIES)
    tied: bool = option(True, "tie the LM head to the embedding")
    hidden_size: int = option(64, "model width", gt=0)
    num_layers: int = option(2, "decoder layers", gt=0)
    num_heads: int = option(2, "attention heads", gt=0)
    num_kv_heads: int = option(1, "key/value heads (divides num_heads)", gt=0)
    head_dim: int = option(32, "per-head width (vLLM's CPU kernels need >= 32)", ge=32)
    intermediate_size: int = option(128, "MLP width", gt=0)
    seed: int = option(0, "random init seed")
    tokenizer: str = option("bpe", "bpe: byte-level BPE; bytes: one token per character", choices=TOKENIZERS)
    vocab_size: int = option(0, f"tokens; 0 = {DEFAULT_VOCAB_SIZE} (bpe) or {BYTES_VOCAB_SIZE} (bytes)", ge=0)
    num_experts: int = option(8, "MoE families: experts per sparse layer (docs/moe.md)", gt=0, le=256)
    num_experts_per_tok: int = option(2, "MoE families: experts each token is routed to", gt=0)
    moe_intermediate_size: int = option(64, "MoE families: expert MLP width", gt=0)
    tool_tokens: bool = option(False, "add Qwen3's <tool_call>/<tool_response> tokens (tool-using envs)")

    def check(self) -> None:
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError("num_experts_per_tok", f"must be <= num_experts ({self.num_experts})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", f"must divide num_heads ({self.num_heads})")
        try:  # the family's tiny shape at these sizes must be a model (e.g. glm4_moe's 2 expert groups)
            self.architecture()
        except (ValueError, NotImplementedError) as e:
            raise ConfigError("family", f"{self.family} at these sizes: {e}") from None
        if self.tokenizer == "bytes" and 0 < self.vocab_size < BYTES_VOCAB_SIZE:
            raise ConfigError("vocab_size", f"a byte tokenizer has {BYTES_VOCAB_SIZE} tokens at least")

    @property
    def resolved_vocab_size(self) -> int:
        return self.vocab_size or (DEFAULT_VOCAB_SIZE if self.tokenizer == "bpe" else BYTES_VOCAB_SIZE)

    def architecture(self, *, max_positions: int = 4096, **overrides: str):
        """The `ModelConfig` this section describes, without building anything (benchmarks with no model dir):
        the family's tiny config.json (`Family.tiny`, what `build` writes) read back."""
        from primejax.models.config import ModelConfig

        shape = dict(
            vocab_size=self.resolved_vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=self.tied,
            rope_theta=ROPE_THETA, num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size, mlp_only_layers=(),
        )  # fmt: skip
        return ModelConfig.from_hf_config(family_of(self.family).tiny(shape), **overrides)

    def build(self, out_dir: str | Path) -> Path:
        """Write the model to `out_dir` (the one place this section becomes `build_tiny_model` arguments)."""
        args = {k: v for k, v in self.to_dict().items() if k != "enabled"}
        return build_tiny_model(out_dir, **args)


def describe(model_dir: str | Path) -> dict:
    """The parameters a tiny model was built with (for test ids and logs)."""
    return json.loads((Path(model_dir) / "primejax_tiny.json").read_text())
