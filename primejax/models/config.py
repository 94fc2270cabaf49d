"""Model configuration: one frozen dataclass for every decoder family (models/families/).

Built from (and written back to) a Hugging Face `config.json`, so a checkpoint directory alone describes the
model: hf_config.py translates the keys every family shares and asks the checkpoint's family
(`families.family_of(model_type)`) for the rest; this module holds the fields, the allowed values of the
training-side ones, and the checks (the family adds its own). Training-side choices (dtypes, attention kernel,
remat policy) are not part of the HF config and come in as overrides. Parameter and FLOP counts: accounting.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from primejax.models import accounting, hf_config
from primejax.models.families import FAMILIES, Family, family_of
from primejax.models.families.base import FULL_ATTENTION, LINEAR_ATTENTION

ATTENTION_IMPLS = ("xla", "cudnn", "splash", "auto")
# Remat policies, applied per decoder layer (see `remat.resolve_remat_policy`):
#   none           keep every activation (fastest, most memory)
#   full           save only the layer input; recompute the whole layer in the backward pass
#   dots           save the outputs of all matmuls (projections and attention scores), recompute elementwise ops
#   dots_no_batch  save only matmuls without batch dimensions (the weight projections), recompute attention
#   attn           save only the attention kernel's output (+ softmax stats); recompute the rest of the layer
#   dots_no_batch_attn  dots_no_batch plus the attention output: only elementwise ops are recomputed
#   attn_offload   attn, with the attention outputs offloaded to pinned host memory (long rows; docs/scaling.md)
#   attn_experts_offload  attn, and the experts' gate/up grouped-matmul output offloaded to pinned host memory
#                  instead of recomputed (MoE; slower than attn on H200 PCIe hosts: docs/memory.md)
#   auto           dots_no_batch_attn up to 32k tokens per micro-batch, attn beyond (fastest measured, and
#                  the long rows fit: see remat.resolve_remat_policy and docs/benchmarks.md)
REMAT_POLICIES = (
    "none",
    "full",
    "dots",
    "dots_no_batch",
    "attn",
    "dots_no_batch_attn",
    "attn_offload",
    "attn_experts_offload",
    "auto",
)
_DTYPES = ("float32", "bfloat16", "float16")
# The model_types whose checkpoints have experts, as registered in models/families/.
MOE_MODEL_TYPES = tuple(t for t, f in FAMILIES.items() if f.moe)
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)  # the token mixers (transformer.MIXERS)
# How a MoE router turns its logits into experts and combine weights (models/moe.py `route`):
#   softmax  Qwen3-MoE: softmax over all experts, top-k of the probabilities
#   sigmoid  GLM-4.5 / DeepSeek-V3: a sigmoid score per expert; the top-k is chosen on score + a fixed
#            correction bias (e_score_correction_bias) among the experts of the topk_group best of n_group
#            groups; the combine weights are the chosen scores (renormalized if norm_topk_prob) times
#            routed_scaling_factor
ROUTER_SCORING = ("softmax", "sigmoid")
# Grouped-matmul implementations for the experts (models/gmm.py): "xla" = jax.lax.ragged_dot (any backend),
# "mgpu" = the Pallas Mosaic-GPU kernels (Hopper), "auto" = mgpu on a Hopper GPU, xla elsewhere.
GMM_IMPLS = ("xla", "mgpu", "auto")
# How the experts are laid out over the mesh (models/moe.py): "fsdp" = experts split over their mesh axis and
# all-gathered per layer with every token kept on its device, "ep" = experts split over that axis and tokens
# exchanged (all-gather in, reduce-scatter out).
EXPERT_PARALLEL = ("fsdp", "ep", "a2a")
A2A_IMPLS = ("auto", "ragged", "padded")  # expert_parallel="a2a"'s exchange (models/moe_a2a.py)
A2A_CAPACITY_FACTOR = (
    1.5  # a2a's default slot per peer and round and pair window, in balanced shares (moe_a2a.py)
)


# The keys that keep a sparse layer's transfer for the backward under remat, the expert_parallel mode each
# needs, and why no other mode has that transfer (models/moe.py, models/moe_a2a.py)
KEPT_TRANSFERS = {
    "keep_gathered_experts": ("fsdp", "its experts are never gathered"),
    "keep_exchanged_tokens": ("a2a", "it exchanges no tokens by all-to-all"),
}


def kept_transfer_problems(section) -> Iterator[tuple[str, str]]:
    """(key, why) for each KEPT_TRANSFERS key that `section` (a ModelConfig or the model config section) turns
    on outside the expert_parallel mode it needs."""
    for key, (mode, why) in KEPT_TRANSFERS.items():
        if getattr(section, key) and section.expert_parallel != mode:
            yield key, f"needs expert_parallel={mode!r} (got {section.expert_parallel!r}: {why})"


def a2a_capacity_problem(factor: float) -> str | None:
    """Why `factor` is not a usable a2a_capacity_factor (None when it is): finite, and <= 0 or >= 1."""
    if not math.isfinite(factor):
        return f"{factor} is not finite"
    if 0 < factor < 1:
        return f"{factor} is below 1: every batch would take extra rounds (<= 0: worst-case slots)"
    return None


# The Gated DeltaNet's chunk recurrence (models/deltanet.py): "xla" = a lax.scan over chunks (any backend),
# "pallas" = the Triton kernels of models/deltanet_pallas.py (GPU), "auto" = pallas on an NVIDIA GPU (Ampere on), xla elsewhere.
DELTANET_IMPLS = ("xla", "pallas", "auto")
# LoRA adapter targets (models/lora.py, docs/lora.md): the attention projections, the dense MLP's, every
# expert of the sparse layers (per-expert adapters on gate, up and down) and the MoE router.
LORA_INITS = ("kaiming", "gaussian")  # the adapters' A (B starts at zero): models/lora.py
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "experts",
    "router",
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool  # bias on the q/k/v projections (qwen2; llama/qwen3 with attention_bias=true)
    max_position_embeddings: int
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    attention_impl: str = "xla"
    remat_policy: str = "none"
    # Decoder layers as one `lax.scan` over stacked weights (traced and compiled once) or unrolled. Unrolled
    # is the default: the scan copies every layer's saved activations into its stacked outputs and schedules
    # each layer alone, so unrolled steps are faster and peak lower, for a longer compile (measurements:
    # docs/benchmarks.md, "unrolled layers").
    scan_layers: bool = False
    # Layers per iteration of that scan. Above 1, one layer's weight gathers (FSDP) can run under the previous
    # layer's compute in the same iteration: the scheduler does not move collectives across iterations.
    scan_unroll: int = 1
    # Llama/Qwen3 `attention_bias=true` also puts a bias on o_proj; Qwen2 never does.
    attention_out_bias: bool = False
    # Mixture of experts (qwen3_moe). num_experts=0: dense. A layer is sparse unless listed in mlp_only_layers
    # and when (layer + 1) % decoder_sparse_step == 0, as in transformers' Qwen3MoeDecoderLayer.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    gmm_impl: str = "auto"
    expert_parallel: str = "fsdp"
    a2a_impl: str = "auto"
    # a2a's per-peer slot per round: this factor x the balanced share of tokens that visit a peer (<= 0: all N,
    # one round), and round 0's window of received pairs: this factor x N*k. Rounds past the first and pairs
    # past the window run only when some batch needs them (models/moe_a2a.py)
    a2a_capacity_factor: float = A2A_CAPACITY_FACTOR
    # expert_parallel="fsdp" under remat: each sparse layer's all-gathered experts are saved for the backward
    # instead of gathered again (E*3*D*I compute-dtype elements per layer and device; models/moe.py)
    keep_gathered_experts: bool = False
    # expert_parallel="a2a" under remat: each sparse layer's received tokens (with their expert ids and scores)
    # are saved for the backward, so its recompute runs no exchange (P*c*(D + 2k) elements per layer and device,
    # c the slot per peer; models/moe_a2a.py)
    keep_exchanged_tokens: bool = False
    deltanet_impl: str = "auto"
    router_scoring: str = "softmax"
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    # Shared experts (glm4_moe): one dense SwiGLU of width moe_intermediate_size * n_shared_experts that every
    # token of a sparse layer goes through, added to the routed experts' output.
    n_shared_experts: int = 0
    # Qwen3.5 MoE's one shared expert: its own width (0 = moe_intermediate_size * n_shared_experts, GLM-4.5's)
    # and a per-token sigmoid gate on its output (`shared_expert_gate` [D] per sparse layer).
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # Rotary embedding on the first head_dim * partial_rotary_factor dims of q/k only (GLM-4.5: 0.5).
    partial_rotary_factor: float = 1.0
    # Multi-head latent attention (deepseek_v3, models/mla.py), on when kv_lora_rank > 0. head_dim is then the
    # rope part of a query/key head (qk_rope_head_dim, as transformers sets it), qk_nope_head_dim its other
    # part, v_head_dim a value head; q_lora_rank 0 stands for DeepSeek's None (q_proj without a bottleneck).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # DeepSeek's rope layout: interleaved pairs (models/layers.py)
    # Qwen3.5's hybrid stack (qwen3_5_text; models/deltanet.py, models/families/qwen3_5.py): each layer's token mixer,
    # "full_attention" or "linear_attention" (Gated DeltaNet); () = every layer full attention. The linear_*
    # fields size the DeltaNet layers. attn_output_gate: q_proj also gives a per-head sigmoid gate on the
    # attention output; norm_offset: RMSNorm weights are stored zero-centered and applied as 1 + w.
    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    attn_output_gate: bool = False
    norm_offset: bool = False
    # LoRA (training-side, from the `model.lora` section; never written to config.json): rank 0 = no adapters.
    # The adapters are separate parameters next to the frozen weights they adapt (models/lora.py).
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()
    lora_init: str = "kaiming"
    # Fields of the source config.json we do not model but must write back unchanged (token ids, etc.).
    hf_extra: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        family = family_of(self.model_type)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {_DTYPES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={self.attention_impl!r} is not one of {ATTENTION_IMPLS}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={self.remat_policy!r} is not one of {REMAT_POLICIES}")
        if self.gmm_impl not in GMM_IMPLS:
            raise ValueError(f"gmm_impl={self.gmm_impl!r} is not one of {GMM_IMPLS}")
        if self.expert_parallel not in EXPERT_PARALLEL:
            raise ValueError(f"expert_parallel={self.expert_parallel!r} is not one of {EXPERT_PARALLEL}")
        if self.a2a_impl not in A2A_IMPLS:
            raise ValueError(f"a2a_impl={self.a2a_impl!r} is not one of {A2A_IMPLS}")
        if problem := a2a_capacity_problem(self.a2a_capacity_factor):
            raise ValueError(f"a2a_capacity_factor={problem}")
        for key, problem in kept_transfer_problems(self):
            raise ValueError(f"{key} {problem}")
        if self.deltanet_impl not in DELTANET_IMPLS:
            raise ValueError(f"deltanet_impl={self.deltanet_impl!r} is not one of {DELTANET_IMPLS}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                )
            if self.num_experts > 256:
                raise ValueError(
                    f"num_experts={self.num_experts}: at most 256 (routed experts travel as uint8)"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError(
                    "moe_intermediate_size and decoder_sparse_step must be positive with num_experts > 0"
                )
            if self.scan_layers and 0 < len(self.sparse_layers()) < self.num_layers:
                raise ValueError(
                    "scan_layers=True needs every layer dense or every layer sparse (mlp_only_layers)"
                )
        if self.scan_unroll < 1:
            raise ValueError(f"scan_unroll={self.scan_unroll} must be >= 1")
        if self.router_scoring not in ROUTER_SCORING:
            raise ValueError(f"router_scoring={self.router_scoring!r} is not one of {ROUTER_SCORING}")
        if self.num_experts and (
            self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group
        ):
            raise ValueError(
                f"n_group={self.n_group} must divide num_experts={self.num_experts} and topk_group="
                f"{self.topk_group} be in [1, n_group]"
            )
        if (
            self.lora_rank < 0
            or self.lora_init not in LORA_INITS
            or any(t not in LORA_TARGETS for t in self.lora_targets)
        ):
            raise ValueError(
                f"lora_rank={self.lora_rank} / lora_targets={self.lora_targets}: rank >= 0, targets "
                f"among {LORA_TARGETS}"
            )
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(
                "group-limited routing scores a group by its two best experts: >= 2 experts per group"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim={self.rotary_dim}: must be "
                f"even and in (0, head_dim={self.head_dim}]"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            supported = family.rope_types
            if rope_type not in supported:
                raise NotImplementedError(
                    f"rope scaling type {rope_type!r} is not implemented for {self.model_type} (supported: "
                    f"{', '.join(supported)})"
                )
        if self.layer_types:
            self._check_layer_types(family)
        if self.mla:
            self._check_mla()
            if self.lora_rank:
                raise NotImplementedError(
                    "LoRA on multi-head latent attention (deepseek_v3) is not implemented"
                )
        family.check(self)

    def _check_layer_types(self, family: Family) -> None:
        if len(self.layer_types) != self.num_layers or any(t not in family.mixers for t in self.layer_types):
            raise ValueError(
                f"layer_types must give one of {family.mixers} ({self.model_type}'s layer kinds) for each of the "
                f"{self.num_layers} layers"
            )
        if self.linear_attention_layers():
            dims = (self.linear_conv_kernel_dim, self.linear_key_head_dim, self.linear_value_head_dim,
                    self.linear_num_key_heads, self.linear_num_value_heads)  # fmt: skip
            if min(dims) <= 0 or self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    "Gated DeltaNet layers need positive linear_* sizes and linear_num_value_heads a multiple of "
                    "linear_num_key_heads"
                )
        if self.scan_layers and len(set(self.layer_types)) > 1:
            raise ValueError("scan_layers=True needs every layer of one kind: a hybrid stack runs unrolled")

    def _check_mla(self) -> None:
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"multi-head latent attention expands its latent to every head: num_key_value_heads="
                f"{self.num_kv_heads} must equal num_attention_heads={self.num_heads}"
            )
        if (
            self.attention_bias
            or self.attention_out_bias
            or self.qk_norm
            or self.partial_rotary_factor != 1.0
        ):
            raise NotImplementedError(
                "multi-head latent attention with attention_bias, qk norm or partial rotary is not implemented"
            )
        if self.qk_nope_head_dim <= 0 or self.v_head_dim <= 0 or self.q_lora_rank < 0:
            raise ValueError("multi-head latent attention needs qk_nope_head_dim > 0 and v_head_dim > 0")
        if self.v_head_dim > self.qk_head_dim:
            raise ValueError(f"v_head_dim={self.v_head_dim} exceeds qk_nope_head_dim + qk_rope_head_dim")

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (deepseek_v3) instead of grouped-query attention."""
        return self.kv_lora_rank > 0

    def full_attention_layers(self) -> tuple[int, ...]:
        """Indices of the (softmax) attention layers: their attention weights are stacked in this order."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == "full_attention")

    def linear_attention_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers (qwen3_5_text): their weights are stacked in this order."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == "linear_attention")

    def layer_type(self, layer: int) -> str:
        """The token mixer of `layer` (transformer.MIXERS): `layer_types`' entry, full attention without one."""
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    @property
    def family(self) -> Family:
        """This model_type's family (models/families/)."""
        return FAMILIES[self.model_type]

    @property
    def qk_head_dim(self) -> int:
        """Width of a query/key head (MLA: nope + rope parts)."""
        return self.qk_nope_head_dim + self.head_dim if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of a value head (and of the attention output per head)."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def lora_scale(self) -> float:
        """The adapters' output scale alpha / rank (PEFT's `scaling`)."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each q/k head that rotary embedding rotates (as transformers: int(Dh * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def __hash__(self) -> int:
        # rope_scaling is a dict; hash a canonical JSON form so the config can be a static jit argument.
        d = dataclasses.asdict(self)
        d.pop("hf_extra")
        return hash(json.dumps(d, sort_keys=True, default=str))

    # ------------------------------------------------------------------ HF config.json (models/hf_config.py)

    @classmethod
    def from_hf_config(cls, hf: dict, **overrides: Any) -> ModelConfig:
        """Map an HF `config.json` dict to a ModelConfig; `overrides` set fields (dtypes, attention_impl, ...)."""
        return cls(**{**hf_config.read_hf_config(hf), **overrides})

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike, **overrides: Any) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(model_dir)!r}")
        return cls.from_hf_config(json.loads(path.read_text()), **overrides)

    def to_hf_config(self, dtype: str | None = None) -> dict:
        """An HF `config.json` dict that transformers and vLLM load unchanged (weights stored in `dtype`,
        param_dtype by default)."""
        return hf_config.write_hf_config(self, dtype)

    # ------------------------------------------------------------------ mixture of experts

    def is_sparse_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def sparse_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers (their experts are stacked in this order)."""
        return tuple(i for i in range(self.num_layers) if self.is_sparse_layer(i))

    def dense_layers(self) -> tuple[int, ...]:
        """Indices of the layers with a dense SwiGLU MLP (all of them for a dense model)."""
        return tuple(i for i in range(self.num_layers) if not self.is_sparse_layer(i))

    @property
    def shared_width(self) -> int:
        """The shared experts' SwiGLU width (0 without shared experts)."""
        if not self.n_shared_experts:
            return 0
        return self.shared_intermediate_size or self.moe_intermediate_size * self.n_shared_experts

    # ------------------------------------------------------------------ accounting (models/accounting.py)

    def num_matmul_params(self) -> int:
        """Weights in a token's matmuls: every layer's plus lm_head, only the active experts of a MoE."""
        return accounting.num_matmul_params(self)

    def num_matmul_params_per_layer(self) -> int:
        return accounting.num_matmul_params_per_layer(self)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), prime-rl's formula."""
        return accounting.flops_per_token(self, seq_len)

    def num_params(self) -> int:
        """All parameters as stored (embedding once when tied, norms and biases included)."""
        return accounting.num_params(self)
