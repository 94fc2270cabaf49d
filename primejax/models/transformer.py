"""The causal decoder every family runs (Flax NNX); the families (models/families/) only configure it.

Layer parameters are stacked on a leading `layers` axis and the forward pass applies one pure layer function
per layer, unrolled by default or as a `lax.scan` (`ModelConfig.scan_layers`: traced and compiled once however
deep the model is); the remat policy (models/remat.py) wraps exactly one layer either way. A layer's kind, its
token mixer and its dense or sparse MLP, picks its functions (`MIXERS`, `MLPS`). The HF name mapping
(hf_io.py) stacks and unstacks at the boundary.

Weights are stored in einsum-friendly layouts, shapes named by their axes:
  embed        [V, D]           q_proj [L, D, H, Dh]   k_proj/v_proj [L, D, K, Dh]   o_proj [L, H, Dh, D]
  gate/up_proj [L, D, F]        down_proj [L, F, D]    lm_head [D, V] (absent when tied)
Letters: B batch, T sequence, D hidden, H query heads, K kv heads, Dh head dim, F MLP width, V vocab.

Mixture of experts (models/moe.py): the dense MLP weights are stacked over the dense layers only and the sparse
layers' weights over the sparse layers only (router [Ls, D, E], experts_gate_up [Ls, E, D, 2, I], experts_down
[Ls, E, I, D]; the sigmoid router adds router_bias [Ls, E] (fp32), shared experts shared_gate_proj/
shared_up_proj [Ls, D, Fs], shared_down_proj [Ls, Fs, D], and a gated shared expert shared_expert_gate
[Ls, D]); attention weights stay stacked over all L layers.

Multi-head latent attention (models/mla.py) replaces q/k/v_proj with its own weights. A hybrid stack
(`layer_types`) mixes Gated DeltaNet layers (models/deltanet.py) with full-attention ones: each kind's weights
are stacked over its own layers (`stacked_over`), the norms and MLP over all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from primejax.models import lora
from primejax.models.attention import SegmentRuns, attention, prepare_segments
from primejax.models.config import ModelConfig
from primejax.models.context_parallel import to_heads, to_tokens
from primejax.models.deltanet import gated_deltanet
from primejax.models.families.base import FULL_ATTENTION, LINEAR_ATTENTION
from primejax.models.layers import apply_rope, rms_norm, rope_tables
from primejax.models.mla import attention_scale as mla_attention_scale
from primejax.models.mla import mla_qkv
from primejax.models.moe import moe_block, router_partials, router_stats
from primejax.models.precision import accumulating_einsum
from primejax.models.remat import ATTN_OUT, layer_policy, resolve_remat_policy
from primejax.models.sharding import constrain, create_sharded

_INIT_STD = 0.02  # HF initializer_range default for these families


def _param(
    rngs: nnx.Rngs | None,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    dtype,
    *,
    ones=False,
    zeros=False,
):
    assert len(shape) == len(axes), (shape, axes)
    if ones or zeros:
        value = jnp.ones(shape, dtype) if ones else jnp.zeros(shape, dtype)
    else:
        value = (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


def _gqa_qkv(cfg: ModelConfig, p: dict[str, jax.Array], h_btd, cos, sin):
    """q [B, T, H, Dh], k/v [B, T, K, Dh] of grouped-query attention (every family but deepseek_v3), with the
    LoRA adapters (models/lora.py) of the projections that have them, and Qwen3.5's output gate [B, T, H, Dh]
    (the second half of each head's q_proj columns; None without `attn_output_gate`)."""
    dt, eps, s = h_btd.dtype, cfg.rms_norm_eps, cfg.lora_scale
    q_btnh = lora.with_adapter(
        jnp.einsum("btd,dnh->btnh", h_btd, p["q_proj"].astype(dt)), h_btd, p, "q_proj", s
    )
    gate_btnh = None
    if cfg.attn_output_gate:
        q_btnh, gate_btnh = q_btnh[..., : cfg.head_dim], q_btnh[..., cfg.head_dim :]
    k_btkh = lora.with_adapter(
        jnp.einsum("btd,dkh->btkh", h_btd, p["k_proj"].astype(dt)), h_btd, p, "k_proj", s
    )
    v_btkh = lora.with_adapter(
        jnp.einsum("btd,dkh->btkh", h_btd, p["v_proj"].astype(dt)), h_btd, p, "v_proj", s
    )
    if cfg.attention_bias:
        q_btnh = q_btnh + p["q_bias"].astype(dt)
        k_btkh = k_btkh + p["k_bias"].astype(dt)
        v_btkh = v_btkh + p["v_bias"].astype(dt)
    if cfg.qk_norm:
        q_btnh = rms_norm(q_btnh, p["q_norm"], eps, offset=cfg.norm_offset)
        k_btkh = rms_norm(k_btkh, p["k_norm"], eps, offset=cfg.norm_offset)
    return apply_rope(q_btnh, cos, sin), apply_rope(k_btkh, cos, sin), v_btkh, gate_btnh


def _attention(cfg: ModelConfig, p: dict[str, jax.Array], h_btd, segment_ids, cos, sin, runs) -> jax.Array:
    """The softmax attention token mixer [B, T, D] -> [B, T, D] (GQA or MLA, with Qwen3.5's output gate)."""
    dt, s = h_btd.dtype, cfg.lora_scale
    gate_btnh = None
    if cfg.mla:
        q_btnh, k_btkh, v_btkh = mla_qkv(cfg, p, h_btd, cos, sin)
        scale = mla_attention_scale(cfg)
    else:
        q_btnh, k_btkh, v_btkh, gate_btnh = _gqa_qkv(cfg, p, h_btd, cos, sin)
        scale = None
    # Whole rows, heads split, for the kernel: under context parallelism an all-to-all (context_parallel.py).
    q_btnh, k_btkh, v_btkh = to_heads(q_btnh, k_btkh, v_btkh)

    o_btnh = attention(q_btnh, k_btkh, v_btkh, segment_ids, impl=cfg.attention_impl, runs=runs, scale=scale)
    o_btnh = to_tokens(checkpoint_name(o_btnh, ATTN_OUT))
    if gate_btnh is not None:
        o_btnh = o_btnh * jax.nn.sigmoid(gate_btnh)
    o_btd = lora.with_adapter(
        jnp.einsum("btnh,nhd->btd", o_btnh, p["o_proj"].astype(dt)), o_btnh, p, "o_proj", s
    )
    if cfg.attention_out_bias:
        o_btd = o_btd + p["o_bias"].astype(dt)
    return o_btd


def _deltanet(cfg: ModelConfig, p: dict[str, jax.Array], h_btd, segment_ids, cos, sin, runs) -> jax.Array:
    """The Gated DeltaNet token mixer [B, T, D] -> [B, T, D] (models/deltanet.py; no rotary, no kernel runs)."""
    return gated_deltanet(cfg, p, h_btd, segment_ids)


def _dense_mlp(
    cfg: ModelConfig, p: dict[str, jax.Array], h_btd, segment_ids, replay
) -> tuple[jax.Array, None]:
    """The SwiGLU MLP [B, T, D] -> [B, T, D], with the adapters (models/lora.py) of the weights that have them."""
    dt, s = h_btd.dtype, cfg.lora_scale
    g_btf = lora.with_adapter(
        jnp.einsum("btd,df->btf", h_btd, p["gate_proj"].astype(dt)), h_btd, p, "gate_proj", s
    )
    u_btf = lora.with_adapter(
        jnp.einsum("btd,df->btf", h_btd, p["up_proj"].astype(dt)), h_btd, p, "up_proj", s
    )
    a_btf = constrain(jax.nn.silu(g_btf) * u_btf, ("batch", "seq", "act_mlp"))
    y_btd = lora.with_adapter(
        jnp.einsum("btf,fd->btd", a_btf, p["down_proj"].astype(dt)), a_btf, p, "down_proj", s
    )
    return y_btd, None


def _sparse_mlp(cfg: ModelConfig, p: dict[str, jax.Array], h_btd, segment_ids, replay):
    """The mixture of experts [B, T, D] -> ([B, T, D], this layer's routing statistics per token shard: the
    stack combines them once after its layers). `replay` = (experts [B, T, k], mask [B, T]) forces the masked
    tokens onto recorded experts (moe.route)."""
    y_btd, r = moe_block(
        h_btd,
        p,
        top_k=cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob,
        impl=cfg.gmm_impl,
        mode=cfg.expert_parallel,
        a2a_impl=cfg.a2a_impl,
        a2a_capacity_factor=cfg.a2a_capacity_factor,
        keep_gathered_experts=cfg.keep_gathered_experts,
        replay_idx=None if replay is None else replay[0],
        replay_mask=None if replay is None else replay[1],
        scoring=cfg.router_scoring,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        scale=cfg.routed_scaling_factor,
        lora_scale=cfg.lora_scale,
    )
    return y_btd, router_partials(r, segment_ids > 0, cfg.num_experts)


# A layer's kind is (token mixer, MLP): the mixer by HF's `layer_types` name (ModelConfig.layer_type), the MLP
# dense or sparse (ModelConfig.is_sparse_layer). A new kind of layer is one function here and its weights in
# DecoderStack; the families (models/families/) only say which kinds their layers are.
MIXERS = {FULL_ATTENTION: _attention, LINEAR_ATTENTION: _deltanet}
MLPS = {False: _dense_mlp, True: _sparse_mlp}  # by ModelConfig.is_sparse_layer


def layer_kind(cfg: ModelConfig, layer: int) -> tuple[str, bool]:
    """(token mixer, sparse MLP) of model layer `layer`."""
    return cfg.layer_type(layer), cfg.is_sparse_layer(layer)


def decoder_layer(
    cfg: ModelConfig,
    kind: tuple[str, bool],
    p: dict[str, jax.Array],
    x_btd,
    segment_ids,
    cos,
    sin,
    runs: SegmentRuns | None = None,
    replay: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """One pre-norm block of `kind` (`layer_kind`): x + mixer(norm(x)), then + mlp(norm(.)). `p` holds one
    layer's (unstacked) weights.

    `runs`: the attention kernel's per-forward description of the rows (`attention.prepare_segments`).
    Returns (output, routing statistics of a sparse layer or None); `replay` = (experts [B, T, k], mask [B, T])
    forces the masked tokens of a sparse layer onto recorded experts (moe.route).
    """
    mixer, sparse = kind
    eps = cfg.rms_norm_eps
    h_btd = rms_norm(x_btd, p["attn_norm"], eps, offset=cfg.norm_offset)
    o_btd = MIXERS[mixer](cfg, p, h_btd, segment_ids, cos, sin, runs)
    x_btd = constrain(x_btd + o_btd, ("batch", "seq", "act_embed"))

    h_btd = rms_norm(x_btd, p["mlp_norm"], eps, offset=cfg.norm_offset)
    y_btd, stats = MLPS[sparse](cfg, p, h_btd, segment_ids, replay)
    return constrain(x_btd + y_btd, ("batch", "seq", "act_embed")), stats


# Parameters the optimizer leaves unchanged (trainer/optim.py): GLM-4.5's router correction bias steers the
# expert choice only (moe.route stops its gradient); RL post-training keeps the released values.
NOT_TRAINED = ("router_bias",)
# Trained but not weight-decayed beyond norms and biases (trainer/optim.py): Gated DeltaNet's log decay rate
# (decay would pull A = exp(A_log) toward 1, changing every layer's memory length; Mamba and FLA exempt it too).
NOT_DECAYED = ("lin_A_log",)
# Per-layer weights of the MLP part: stacked over the dense layers (dense MLP) or the sparse ones (experts).
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
SPARSE_MLP = (
    "router",
    "router_bias",
    "experts_gate_up",
    "experts_down",
    "shared_gate_proj",
    "shared_up_proj",
    "shared_down_proj",
    "shared_expert_gate",
)
# Per-layer weights of the token mixer, stacked over the layers of their kind (cfg.layer_types): softmax
# attention's over the full-attention layers (all of them but in Qwen3.5's hybrid stack), Gated DeltaNet's
# over the linear-attention ones. Letters: C = 2 Hk dk + Hv dv conv channels, Kc the conv kernel.
#   lin_qkv [Ll, D, C]  lin_conv [Ll, Kc, C]  lin_z [Ll, D, Hv, dv]  lin_a/lin_b [Ll, D, Hv]
#   lin_A_log/lin_dt_bias [Ll, Hv]  lin_norm [Ll, dv]  lin_out [Ll, Hv, dv, D]
FULL_ATTN = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_bias",
    "k_bias",
    "v_bias",
    "o_bias",
    "q_norm",
    "k_norm",
)
LINEAR_ATTN = (
    "lin_qkv",
    "lin_conv",
    "lin_z",
    "lin_a",
    "lin_b",
    "lin_A_log",
    "lin_dt_bias",
    "lin_norm",
    "lin_out",
)


def stacked_over(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The model layers a stacked per-layer weight (or its adapter) covers, in stacking order."""
    base = lora.base_name(name)
    if base in DENSE_MLP:
        return cfg.dense_layers()
    if base in SPARSE_MLP:
        return cfg.sparse_layers()
    if base in FULL_ATTN and cfg.layer_types:
        return cfg.full_attention_layers()
    if base in LINEAR_ATTN:
        return cfg.linear_attention_layers()
    return tuple(range(cfg.num_layers))


class DecoderStack(nnx.Module):
    """All decoder layers, parameters stacked on a leading `layers` axis, applied unrolled or with `lax.scan`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        n, d, h, k, hd, f = (
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        )
        dt = jnp.dtype(cfg.param_dtype)
        lay = "layers"
        unit = dict(zeros=True) if cfg.norm_offset else dict(ones=True)  # Qwen3.5's norms apply 1 + w
        self.attn_norm = _param(rngs, (n, d), (lay, "norm"), dt, **unit)
        if cfg.linear_attention_layers():
            self._init_deltanet(cfg, rngs, dt)
        n = len(cfg.full_attention_layers())  # the attention weights' stack
        if cfg.mla:
            self._init_mla(cfg, rngs, dt)
        else:
            qw = 2 * hd if cfg.attn_output_gate else hd  # Qwen3.5: [query | output gate] per head
            self.q_proj = _param(rngs, (n, d, h, qw), (lay, "embed", "q_heads", "head_dim"), dt)
            self.k_proj = _param(rngs, (n, d, k, hd), (lay, "embed", "kv_heads", "head_dim"), dt)
            self.v_proj = _param(rngs, (n, d, k, hd), (lay, "embed", "kv_heads", "head_dim"), dt)
            self.o_proj = _param(rngs, (n, h, hd, d), (lay, "q_heads", "head_dim", "embed"), dt)
        if cfg.attention_bias:
            # HF zero-initializes biases; small random values make tests exercise them.
            self.q_bias = _param(rngs, (n, h, hd), (lay, "q_heads", "head_dim"), dt)
            self.k_bias = _param(rngs, (n, k, hd), (lay, "kv_heads", "head_dim"), dt)
            self.v_bias = _param(rngs, (n, k, hd), (lay, "kv_heads", "head_dim"), dt)
        if cfg.attention_out_bias:
            self.o_bias = _param(rngs, (n, d), (lay, "norm"), dt)
        if cfg.qk_norm:
            self.q_norm = _param(rngs, (n, hd), (lay, "head_dim"), dt, **unit)
            self.k_norm = _param(rngs, (n, hd), (lay, "head_dim"), dt, **unit)
        n = cfg.num_layers
        self.mlp_norm = _param(rngs, (n, d), (lay, "norm"), dt, **unit)
        nd, ns = len(cfg.dense_layers()), len(cfg.sparse_layers())
        if nd:
            self.gate_proj = _param(rngs, (nd, d, f), (lay, "embed", "mlp"), dt)
            self.up_proj = _param(rngs, (nd, d, f), (lay, "embed", "mlp"), dt)
            self.down_proj = _param(rngs, (nd, f, d), (lay, "mlp", "embed"), dt)
        if ns:
            e, i = cfg.num_experts, cfg.moe_intermediate_size
            self.router = _param(rngs, (ns, d, e), (lay, "embed", None), dt)
            self.experts_gate_up = _param(
                rngs, (ns, e, d, 2, i), (lay, "experts", "expert_embed", None, "expert_mlp"), dt
            )
            self.experts_down = _param(
                rngs, (ns, e, i, d), (lay, "experts", "expert_mlp", "expert_embed"), dt
            )
            if cfg.router_scoring == "sigmoid":
                # fp32 whatever param_dtype, as HF and vLLM keep it: it decides near-ties between experts.
                # HF zero-initializes it; small random values make tests exercise it.
                self.router_bias = _param(rngs, (ns, e), (lay, None), jnp.float32)
            if cfg.n_shared_experts:
                fs = cfg.shared_width
                self.shared_gate_proj = _param(rngs, (ns, d, fs), (lay, "embed", "mlp"), dt)
                self.shared_up_proj = _param(rngs, (ns, d, fs), (lay, "embed", "mlp"), dt)
                self.shared_down_proj = _param(rngs, (ns, fs, d), (lay, "mlp", "embed"), dt)
            if cfg.shared_expert_gate:  # Qwen3.5 MoE: sigmoid(h . w) scales the shared expert's output
                self.shared_expert_gate = _param(rngs, (ns, d), (lay, "embed"), dt)
        # LoRA adapters (fp32 LoraParams named after the weight they adapt), when `cfg.lora_rank` > 0
        specs = lora.stack_adapters(self, cfg)
        if specs:
            for name, var in lora.adapter_params(specs, rngs.params(), cfg.lora_init).items():
                setattr(self, name, var)

    def _init_deltanet(self, cfg: ModelConfig, rngs: nnx.Rngs, dt) -> None:
        """Gated DeltaNet's weights (models/deltanet.py), stacked over the linear-attention layers. The fused
        q/k/v channels are not split over `tensor` (its conv and head split cross the column blocks)."""
        n, d, lay = len(cfg.linear_attention_layers()), cfg.hidden_size, "layers"
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        c = 2 * hk * dk + hv * dv
        self.lin_qkv = _param(rngs, (n, d, c), (lay, "embed", None), dt)
        self.lin_conv = _param(rngs, (n, cfg.linear_conv_kernel_dim, c), (lay, None, None), dt)
        self.lin_z = _param(rngs, (n, d, hv, dv), (lay, "embed", "linear_heads", "head_dim"), dt)
        self.lin_a = _param(rngs, (n, d, hv), (lay, "embed", None), dt)
        self.lin_b = _param(rngs, (n, d, hv), (lay, "embed", None), dt)
        # A = exp(A_log) in [1, 16] and dt_bias = 1 as transformers initializes them (HF: A uniform(0, 16))
        self.lin_A_log = nnx.Param(
            jnp.log(jax.random.uniform(rngs.params(), (n, hv), jnp.float32, 1.0, 16.0)).astype(dt),
            logical_axes=(lay, "norm"),
        )
        self.lin_dt_bias = _param(rngs, (n, hv), (lay, "norm"), dt, ones=True)
        self.lin_norm = _param(rngs, (n, dv), (lay, "norm"), dt, ones=True)
        self.lin_out = _param(rngs, (n, hv, dv, d), (lay, "linear_heads", "head_dim", "embed"), dt)

    def _init_mla(self, cfg: ModelConfig, rngs: nnx.Rngs, dt) -> None:
        """Multi-head latent attention's weights (models/mla.py). The latent ranks are a weight's input
        dimension where `embed` is not: they take its FSDP split (the `latent` rule)."""
        n, d, h, lay = cfg.num_layers, cfg.hidden_size, cfg.num_heads, "layers"
        rq, rkv, dn, dr, dv = (
            cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim
        )  # fmt: skip
        if rq:
            self.q_a_proj = _param(rngs, (n, d, rq), (lay, "embed", None), dt)
            self.q_a_norm = _param(rngs, (n, rq), (lay, "norm"), dt, ones=True)
            self.q_b_proj = _param(rngs, (n, rq, h, dn + dr), (lay, "latent", "q_heads", "head_dim"), dt)
        else:
            self.q_proj = _param(rngs, (n, d, h, dn + dr), (lay, "embed", "q_heads", "head_dim"), dt)
        self.kv_a_proj = _param(rngs, (n, d, rkv + dr), (lay, "embed", None), dt)
        self.kv_a_norm = _param(rngs, (n, rkv), (lay, "norm"), dt, ones=True)
        self.kv_b_proj = _param(rngs, (n, rkv, h, dn + dv), (lay, "latent", "q_heads", "head_dim"), dt)
        self.o_proj = _param(rngs, (n, h, dv, d), (lay, "q_heads", "head_dim", "embed"), dt)

    def stacked_params(self) -> dict[str, jax.Array]:
        return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Param)}

    def __call__(
        self, x_btd, segment_ids, cos, sin, runs: SegmentRuns | None = None, replay=None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """-> (hidden, sparse layers' routing statistics stacked [Ls, ...]; {} for a dense model).

        `replay` = (experts [B, T, Ls, k], mask [B, T]): routing replay for the sparse layers (moe.route).
        """
        cfg = self.cfg
        policy = resolve_remat_policy(cfg.remat_policy, x_btd.shape[0] * x_btd.shape[1])
        if policy != "none":
            fn = layer_policy(cfg, policy, x_btd.dtype)

        @functools.cache
        def step_of(kind):  # one (remat-wrapped) step function per kind of layer
            layer = functools.partial(decoder_layer, cfg, kind)

            def step(x, p, rp):
                return layer(p, x, segment_ids, cos, sin, runs, rp)

            if policy == "none":
                return step
            # Inside a scan CSE cannot merge the recomputation with the forward pass; unrolled it can.
            return jax.checkpoint(step, policy=fn, prevent_cse=not cfg.scan_layers)

        stacked = self.stacked_params()
        sparse = cfg.sparse_layers()
        if cfg.scan_layers:  # every layer of one kind (ModelConfig's checks)
            step = step_of(layer_kind(cfg, 0))
            if not sparse or replay is None:
                x_btd, stats = jax.lax.scan(
                    lambda x, p: step(x, p, None), x_btd, stacked, unroll=cfg.scan_unroll
                )
            else:
                mask = replay[1]
                xs = (stacked, jnp.moveaxis(replay[0], 2, 0))
                x_btd, stats = jax.lax.scan(
                    lambda x, pr: step(x, pr[0], (pr[1], mask)), x_btd, xs, unroll=cfg.scan_unroll
                )
            return x_btd, router_stats(stats, cfg.num_experts) if sparse else {}

        # One split per weight (its transpose is one concatenate of the layers' gradients), not L slices
        # (each of whose transposes pads a full-size zero array).
        def split(v):
            return [a[0] for a in jax.lax.split(v, [1] * v.shape[0], axis=0)]

        per_layer = {k: split(v) for k, v in stacked.items()}
        covers = {k: stacked_over(cfg, k) for k in stacked}  # an adapter goes with the weight it adapts
        per_stats = []
        for i in range(cfg.num_layers):
            rp = None
            if i in sparse and replay is not None:
                rp = (replay[0][:, :, sparse.index(i)], replay[1])
            # the weights this layer has (a sparse layer no dense MLP, a DeltaNet layer no q_proj, ...)
            p = {k: v[covers[k].index(i)] for k, v in per_layer.items() if i in covers[k]}
            x_btd, st = step_of(layer_kind(cfg, i))(x_btd, p, rp)
            if st is not None:
                per_stats.append(st)
        if not per_stats:
            return x_btd, {}
        return x_btd, router_stats(
            {k: jnp.stack([s[k] for s in per_stats]) for k in per_stats[0]}, cfg.num_experts
        )


class Transformer(nnx.Module):
    """Decoder-only LM. `__call__` returns final-normed hidden states; logits are left to the caller."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.param_dtype)
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt)
        self.layers = DecoderStack(cfg, rngs=rngs)
        self.final_norm = _param(
            rngs, (cfg.hidden_size,), ("norm",), dt, ones=not cfg.norm_offset, zeros=cfg.norm_offset
        )
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        max_segments: int | None = None,
    ) -> jax.Array:
        """tokens/positions/segment_ids int32 [B, T] -> hidden states [B, T, D] in the compute dtype."""
        return self.forward_with_aux(tokens, positions, segment_ids, max_segments=max_segments)[0]

    def forward_with_aux(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        max_segments: int | None = None,
        replay: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """tokens/positions/segment_ids int32 [B, T] -> (hidden states [B, T, D], MoE routing statistics).

        The statistics (empty for a dense model) are stacked over the sparse layers: `load` [Ls, E] pairs
        per expert over non-padding tokens, `lb_loss` [Ls] and `z_loss` [Ls] (moe.py). `replay` =
        (experts [B, T, Ls, k] int, mask [B, T] bool) routes the masked tokens to recorded experts.

        Rows may pack several samples: attention is causal within a segment and never crosses segments;
        segment 0 marks padding (its outputs are meaningless and must be masked by the caller), packed last.
        `max_segments` (static) bounds the samples per row; the cudnn kernel's cost grows with it (see
        `attention.runs_for_segments`). A row that breaks the bound comes out all NaN, never silently wrong.
        """
        cfg = self.cfg
        dt = jnp.dtype(cfg.compute_dtype)
        # Gather from a table all-gathered over fsdp (as FSDP does for every weight) but still split over
        # vocab: GSPMD then does a local masked gather plus a reduction instead of replicating the table.
        table_vd = constrain(self.embed[...], ("vocab", None))
        x_btd = jnp.take(table_vd, tokens, axis=0).astype(dt)
        x_btd = constrain(x_btd, ("batch", "seq", "act_embed"))
        cos, sin = rope_tables(positions, cfg, dt)
        runs = prepare_segments(segment_ids, impl=cfg.attention_impl, dtype=dt, max_segments=max_segments)
        x_btd, stats = self.layers(x_btd, segment_ids, cos, sin, runs, replay)
        h_btd = rms_norm(x_btd, self.final_norm[...], cfg.rms_norm_eps, offset=cfg.norm_offset)
        if runs is not None:  # once here rather than per layer: rows the kernel could not describe
            h_btd = jnp.where(runs.overflow[:, None, None], jnp.nan, h_btd)
        return h_btd, stats

    def lm_head_weight(self) -> jax.Array:
        """[D, V] output projection (the embedding transposed when tied), in the parameter dtype."""
        if self.cfg.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def logits(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """float32 [B, T, V]. Materializes full logits: for tests and small inputs only."""
        h_btd = self(tokens, positions, segment_ids)
        w_dv = self.lm_head_weight()
        out = accumulating_einsum("btd,dv->btv", h_btd, w_dv.astype(h_btd.dtype), jnp.float32)
        return constrain(out, ("batch", "seq", "act_vocab"))


def init_model(cfg: ModelConfig, mesh: jax.sharding.Mesh | None, seed: int = 0) -> Transformer:
    """A randomly initialized Transformer (HF-style normal(0.02) weights, unit norms), sharded by the rules."""
    return create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)), mesh)
