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
from typing import Any, Literal

from primejax.utils.io import atomic_write_json
from primejax.utils.sections import ConfigError, Section, option, section

Family = Literal["qwen3", "llama", "qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_5_text", "qwen3_5_moe_text"]
FAMILIES = ("qwen3", "llama", "qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_5_text", "qwen3_5_moe_text")  # the builder's subset of config.ARCHITECTURES
# deepseek_v3's latent widths: vLLM's CPU MLA decode kernel is compiled for a latent cache of 512 + 64 only
# (DeepSeek-V2/V3's kv_lora_rank + qk_rope_head_dim), so a tiny model vLLM serves keeps them.
MLA_KV_LORA_RANK, MLA_ROPE_HEAD_DIM = 512, 64
# The RoPE base of every tiny model: written to its config.json and used by `TinyModelConfig.architecture`.
ROPE_THETA = 1_000_000.0
# deepseek_v3's rope is DeepSeek-V3's released one (its config.json): yarn stretching 4096 positions 40x over
# theta 1e4. It is also what vLLM serves right on CPU: without rope scaling, vLLM's DeepseekV2 takes its CPU
# rotary kernel, which mis-rotates MLA's [tokens, heads, 64] query and key views (docs/models.md).
MLA_ROPE = dict(
    rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
    beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
)  # fmt: skip

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
    family: Family = "qwen3",
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
    """Write a random-init tiny Qwen3, Llama, Qwen3-MoE, GLM-4.5 MoE, DeepSeek-V3, Qwen3.5 (`_qwen3_5_shape`) or
    Qwen3.5 MoE (that hybrid stack, every MLP sparse, one gated shared expert of moe_intermediate_size) model
    (fp32 safetensors) plus tokenizer to `out_dir`.

    "deepseek_v3" has GLM-4.5's MoE structure below (without the q/k/v bias and partial rotary) and multi-head
    latent attention: query bottleneck hidden/2, latent 512 + rope key 64 (vLLM's CPU MLA kernel needs them),
    `head_dim` for the unrotated query/key part and the values, interleaved rope with DeepSeek-V3's yarn
    (`MLA_ROPE`); num_kv_heads is ignored.

    The MoE arguments apply to families "qwen3_moe" (norm_topk_prob on, as in Qwen3-30B-A3B) and "glm4_moe"
    (GLM-4.5's structure: the first layer dense (unless mlp_only_layers says otherwise, as a prefix), one shared
    expert, q/k/v bias, half the head dims rotated, sigmoid routing over 2 expert groups of which 1 is kept,
    routed scaling 2.5, a random correction bias (std 0.1; HF starts it at 0)). Routers are drawn wider
    (std 0.5) than the rest so routing is decided clearly, not by near-ties.

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
        rope_theta=ROPE_THETA,
    )
    if family == "qwen3":
        config = transformers.Qwen3Config(**common)
        model_cls = transformers.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=True,
            mlp_only_layers=list(mlp_only_layers),
        )
        model_cls = transformers.Qwen3MoeForCausalLM
    elif family == "glm4_moe":
        common.pop("rope_theta")
        config = transformers.Glm4MoeConfig(
            **common,
            rope_parameters=dict(rope_type="default", rope_theta=ROPE_THETA, partial_rotary_factor=0.5),
            n_routed_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=True,
            first_k_dense_replace=len(mlp_only_layers) if mlp_only_layers else 1,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            attention_bias=True,
            num_nextn_predict_layers=0,
        )
        model_cls = transformers.Glm4MoeForCausalLM
    elif family == "deepseek_v3":
        common.pop("rope_theta")
        common.update(num_key_value_heads=num_heads, head_dim=MLA_ROPE_HEAD_DIM)
        config = transformers.DeepseekV3Config(
            **common,
            **_deepseek_v3_shape(hidden_size, head_dim),
            rope_parameters=dict(MLA_ROPE),
            n_routed_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=True,
            first_k_dense_replace=len(mlp_only_layers) if mlp_only_layers else 1,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            num_nextn_predict_layers=0,
        )
        model_cls = transformers.DeepseekV3ForCausalLM
    elif family == "qwen3_5_text":
        common.pop("rope_theta")
        config = transformers.Qwen3_5TextConfig(
            **common,
            **_qwen3_5_shape(num_layers, num_heads, head_dim),
            rope_parameters=dict(rope_type="default", rope_theta=ROPE_THETA, partial_rotary_factor=0.25),
        )
        model_cls = transformers.Qwen3_5ForCausalLM
    elif family == "qwen3_5_moe_text":  # every layer sparse: no dense MLP width; a shared expert as wide as one
        common.pop("rope_theta")
        common.pop("intermediate_size")
        config = transformers.Qwen3_5MoeTextConfig(
            **common,
            **_qwen3_5_shape(num_layers, num_heads, head_dim),
            rope_parameters=dict(rope_type="default", rope_theta=ROPE_THETA, partial_rotary_factor=0.25),
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            shared_expert_intermediate_size=moe_intermediate_size,
        )
        model_cls = transformers.Qwen3_5MoeForCausalLM
    elif family == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown family {family!r} (expected one of {FAMILIES})")

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    if family in ("qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_5_moe_text"):
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


def _deepseek_v3_shape(hidden_size: int, head_dim: int) -> dict[str, Any]:
    """build_tiny_model's multi-head latent attention: a query bottleneck of hidden/2, vLLM's CPU latent widths
    (MLA_KV_LORA_RANK + MLA_ROPE_HEAD_DIM), and `head_dim` for the unrotated query/key part and the values."""
    return dict(
        q_lora_rank=max(hidden_size // 2, 16), kv_lora_rank=MLA_KV_LORA_RANK, qk_rope_head_dim=MLA_ROPE_HEAD_DIM,
        qk_nope_head_dim=head_dim, v_head_dim=head_dim, rope_interleave=True,
    )  # fmt: skip


def _qwen3_5_shape(num_layers: int, num_heads: int, head_dim: int) -> dict[str, Any]:
    """build_tiny_model's Qwen3.5 hybrid: full attention every 4th layer and last (so 2 layers are one of each),
    Gated DeltaNet with num_heads key heads and twice as many value heads of head_dim, conv kernel 4."""
    every = min(4, num_layers)
    return dict(
        layer_types=["linear_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)],
        linear_num_key_heads=num_heads, linear_num_value_heads=2 * num_heads, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
    )  # fmt: skip


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
        if self.family in ("glm4_moe", "deepseek_v3") and (self.num_experts % 2 or self.num_experts < 4):
            raise ConfigError("num_experts", f"{self.family} routes over 2 expert groups: an even number, at least 4")
        if self.tokenizer == "bytes" and 0 < self.vocab_size < BYTES_VOCAB_SIZE:
            raise ConfigError("vocab_size", f"a byte tokenizer has {BYTES_VOCAB_SIZE} tokens at least")

    @property
    def resolved_vocab_size(self) -> int:
        return self.vocab_size or (DEFAULT_VOCAB_SIZE if self.tokenizer == "bpe" else BYTES_VOCAB_SIZE)

    def architecture(self, *, max_positions: int = 4096, **overrides: str):
        """The `ModelConfig` this section describes, without building anything (benchmarks with no model dir)."""
        from primejax.models.config import ModelConfig

        mla = self.family == "deepseek_v3"
        fields = {"intermediate_size": self.intermediate_size, **self._moe_fields(), **self._mla_fields(),
                  **self._qwen3_5_fields()}  # fmt: skip
        return ModelConfig(
            model_type=self.family,
            vocab_size=self.resolved_vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_heads if self.family == "deepseek_v3" else self.num_kv_heads,
            head_dim=MLA_ROPE_HEAD_DIM if self.family == "deepseek_v3" else self.head_dim,
            rope_theta=MLA_ROPE["rope_theta"] if mla else ROPE_THETA,
            rope_scaling={k: v for k, v in MLA_ROPE.items() if k != "rope_theta"} if mla else None,
            rms_norm_eps=1e-6,
            tie_word_embeddings=self.tied,
            qk_norm=self.family in ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text"),
            attention_bias=self.family == "glm4_moe",
            max_position_embeddings=max_positions,
            **{**fields, **overrides},
        )

    def _qwen3_5_fields(self) -> dict:
        if self.family not in ("qwen3_5_text", "qwen3_5_moe_text"):
            return {}
        shape = _qwen3_5_shape(self.num_layers, self.num_heads, self.head_dim)
        shape["layer_types"] = tuple(shape["layer_types"])
        return dict(shape, attn_output_gate=True, norm_offset=True, partial_rotary_factor=0.25)

    def _mla_fields(self) -> dict:
        if self.family != "deepseek_v3":
            return {}
        shape = _deepseek_v3_shape(self.hidden_size, self.head_dim)
        shape.pop("qk_rope_head_dim")  # ModelConfig.head_dim
        return shape

    def _moe_fields(self) -> dict:
        if self.family not in ("qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_5_moe_text"):
            return {}
        moe = dict(
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=True,
        )
        if self.family in ("glm4_moe", "deepseek_v3"):  # build_tiny_model's GLM-4.5 / DeepSeek-V3 structure
            moe.update(
                mlp_only_layers=(0,), router_scoring="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5,
                n_shared_experts=1,
            )  # fmt: skip
        if self.family == "glm4_moe":
            moe.update(partial_rotary_factor=0.5)
        if self.family == "qwen3_5_moe_text":  # build_tiny_model's: every layer sparse, one gated shared expert
            moe.update(intermediate_size=0, n_shared_experts=1, shared_intermediate_size=self.moe_intermediate_size,
                       shared_expert_gate=True)  # fmt: skip
        return moe

    def build(self, out_dir: str | Path) -> Path:
        """Write the model to `out_dir` (the one place this section becomes `build_tiny_model` arguments)."""
        args = {k: v for k, v in self.to_dict().items() if k != "enabled"}
        return build_tiny_model(out_dir, **args)


def describe(model_dir: str | Path) -> dict:
    """The parameters a tiny model was built with (for test ids and logs)."""
    return json.loads((Path(model_dir) / "primejax_tiny.json").read_text())
