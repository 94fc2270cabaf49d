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
from typing import Literal

from primejax.utils.io import atomic_write_json

Family = Literal["qwen3", "llama"]

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


def build_tokenizer(out_dir: Path, *, vocab_size: int = DEFAULT_VOCAB_SIZE, corpus: list[str] | None = None,
                    tool_tokens: bool = False):
    """Train a byte-level BPE on `corpus` (built-in if None) and save it as an HF fast tokenizer in out_dir.

    `tool_tokens` adds Qwen3's tool-call markers after the BPE vocabulary (the merges are unchanged)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus if corpus is not None else _builtin_corpus(), trainer=trainer)
    added = THINK_TOKENS + (TOOL_TOKENS if tool_tokens else [])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
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
    family: Family = "qwen3",
    tied: bool = True,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    seed: int = 0,
    corpus: list[str] | None = None,
    init_std: float = 0.02,
    max_position_embeddings: int = 4096,
    tool_tokens: bool = False,
) -> Path:
    """Write a random-init tiny Qwen3 or Llama model (fp32 safetensors) plus tokenizer to `out_dir`.

    `vocab_size` is the BPE target size (default 384); the model's vocab equals the trained tokenizer's
    size so every id the model can sample decodes. head_dim must be >= 32 (vLLM's CPU attention kernels).
    Deterministic given `seed` and `corpus`. `tool_tokens` adds Qwen3's `<tool_call>`/`<tool_response>` markers.
    """
    import torch
    import transformers

    if head_dim < 32:
        raise ValueError(f"head_dim={head_dim}: vLLM's CPU attention needs head_dim >= 32")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(out, vocab_size=vocab_size or DEFAULT_VOCAB_SIZE, corpus=corpus,
                                tool_tokens=tool_tokens)
    n_vocab = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + THINK_TOKENS}

    common = dict(
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
        rope_theta=1_000_000.0,
    )
    if family == "qwen3":
        config = transformers.Qwen3Config(**common)
        model_cls = transformers.Qwen3ForCausalLM
    elif family == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown family {family!r} (expected 'qwen3' or 'llama')")

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
    )
    model.save_pretrained(str(out))
    # Written last: its presence marks a complete build (fixtures that cache model dirs check it).
    atomic_write_json(out / "primejax_tiny.json", {"family": family, "tied": tied, "seed": seed,
                                                          "tool_tokens": tool_tokens})
    return out


def describe(model_dir: str | Path) -> dict:
    """The parameters a tiny model was built with (for test ids and logs)."""
    return json.loads((Path(model_dir) / "primejax_tiny.json").read_text())
