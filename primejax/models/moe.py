"""Sparse MoE block (Qwen3-MoE, GLM-4.5, DeepSeek-V3, Qwen3.5 MoE): fp32 router, dropless experts by grouped matmul, routing replay.

Routers (ModelConfig.router_scoring): Qwen3-MoE's top-k softmax, or GLM-4.5's sigmoid scores with a fixed
correction bias, group-limited top-k and a routed scaling factor; GLM-4.5's shared experts are a dense SwiGLU
added in `moe_block`.

Weights of one sparse layer (stacked over the sparse layers in DecoderStack):
  router   [D, E]           experts_gate_up [E, D, 2, I] (gate first, as HF's fused gate_up_proj)
  experts_down [E, I, D]
Letters: N tokens, D hidden, E experts, k experts per token, I expert MLP width.

Dropless: every (token, expert) pair is computed, as vLLM does; a capacity limit would drop pairs the sampler
kept and add trainer/sampler mismatch. The pairs are sorted by expert and run as one grouped matmul per
projection (models/gmm.py), then weighted by their routing scores and summed back per token.

Routing replay (R3): `replay_idx [N, k]` with `replay_mask [N]` forces the marked tokens onto the recorded
experts (those vLLM used when it sampled them); the scores are the router's probabilities gathered at those
experts, so the router still gets a gradient through them.

Expert parallelism over the mesh's `fsdp` axis (ModelConfig.expert_parallel; the `experts` logical axis in
sharding.SHARDING_RULES):
- "fsdp": tokens stay on their device; each layer's experts are all-gathered (like any FSDP weight) and their
  gradient reduce-scattered. No token traffic, weight traffic E*3*D*I per layer.
- "ep": experts stay on their device; the tokens (and routing) are all-gathered over fsdp, each device runs
  its own experts on the pairs routed to them, and the partial outputs are reduce-scattered back. Token
  traffic ~2*N*D per layer, no expert-weight traffic.
- "a2a": experts stay on their device; each token's row is sent once to every device holding one of its
  experts and one weighted row comes back, by all-to-all (moe_a2a.py): at most P*N rows each way, the expert
  MLP on local experts and received pairs only.
Both run inside `shard_map` so the sort and the grouped matmul stay per device, with the tokens split over
every axis that splits the batch (data, fsdp, and context under context parallelism).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from primejax.models.config import A2A_CAPACITY_FACTOR
from primejax.models.gmm import expert_mlp, sort_pairs
from primejax.models.sharding import constrain, current_mesh, logical_to_spec, mesh_axes

(EP_AXIS,) = mesh_axes("experts")  # the one mesh axis experts are split over (the sharding table)
# checkpoint_name of a sparse layer's all-gathered experts under ModelConfig.keep_gathered_experts: the layer's
# remat policy saves them, so its backward reuses them instead of gathering them again (transformer.py)
EXPERTS_GATHERED = "moe_experts_gathered"


class RouterOut(NamedTuple):
    """Per-layer routing results kept for metrics and losses (all fp32 / int32, shapes [N, ...])."""

    logits: jax.Array  # [N, E] fp32 router logits
    probs: jax.Array  # [N, E] fp32 softmax (sigmoid router: the scores normalized to sum 1, for the aux loss)
    topk_idx: jax.Array  # [N, k] int32 experts used
    scores: jax.Array  # [N, k] fp32 combine weights


def route(
    h_nd: jax.Array,
    router_de: jax.Array,
    top_k: int,
    norm_topk_prob: bool,
    replay_idx: jax.Array | None = None,
    replay_mask: jax.Array | None = None,
    *,
    scoring: str = "softmax",
    bias_e: jax.Array | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scale: float = 1.0,
) -> RouterOut:
    """Top-k routing in fp32, optionally replaying recorded experts.

    softmax (HF Qwen3MoeTopKRouter): top-k of the softmax probabilities. sigmoid (HF Glm4MoeTopkRouter): scores
    s = sigmoid(logits); the experts are chosen on s + bias_e (the correction bias steers the choice only, it
    is not trained: stop_gradient) among the `topk_group` groups whose two best experts score highest; the
    combine weights are s at the chosen experts. Replayed tokens take the recorded experts and the weights
    at those experts, so the router still gets a gradient through them.
    """
    logits = jnp.einsum("nd,de->ne", h_nd.astype(jnp.float32), router_de.astype(jnp.float32))
    if scoring == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        weights, choice = probs, probs
    else:
        weights = jax.nn.sigmoid(logits)
        probs = weights / jnp.sum(weights, axis=-1, keepdims=True)
        choice = weights if bias_e is None else weights + jax.lax.stop_gradient(bias_e.astype(jnp.float32))
        if n_group > 1:
            choice = _group_limited(choice, n_group, topk_group)
    _, top_i = jax.lax.top_k(choice, top_k)
    if replay_idx is not None:
        top_i = jnp.where(replay_mask[:, None], replay_idx.astype(jnp.int32), top_i)
    top_p = jnp.take_along_axis(weights, top_i, axis=-1)  # the router's gradient flows through these
    if norm_topk_prob:
        # GLM-4.5 adds 1e-20 to the denominator; a softmax top-k sum is never that small.
        top_p = top_p / (jnp.sum(top_p, axis=-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    if scale != 1.0:
        top_p = top_p * scale
    return RouterOut(logits, probs, top_i.astype(jnp.int32), top_p)


def _group_limited(choice_ne: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """`choice` with every expert outside the `topk_group` best groups set to -inf (a group's score is the sum
    of its two best experts' choice values, as DeepSeek-V3's and GLM-4.5's noaux_tc routing)."""
    n, e = choice_ne.shape
    grouped = choice_ne.reshape(n, n_group, e // n_group)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
    _, best = jax.lax.top_k(group_score, topk_group)
    keep = jnp.any(best[:, :, None] == jnp.arange(n_group)[None, None, :], axis=1)  # [N, G]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, e)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x_nd, order, inv, k):
    """Rows of x for the (token, expert) pairs in expert order: x[order // k] -> [N*k, D].

    A gather forward and backward: the gradient of each token sums its k pairs' rows, read through the
    inverse permutation (XLA's transpose of the gather would be a scatter-add, atomics on GPU).
    """
    return jnp.take(x_nd, order // k, axis=0)


def _dispatch_fwd(x_nd, order, inv, k):
    return _dispatch(x_nd, order, inv, k), (order, inv)


def _dispatch_bwd(k, res, g):
    order, inv = res
    n = inv.shape[0] // k
    dx = jnp.take(g, inv, axis=0).reshape(n, k, g.shape[-1]).astype(jnp.float32).sum(axis=1)
    return dx.astype(g.dtype), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _permute(x, perm, inv):
    """x[perm] whose gradient is the gather g[inv] (perm a permutation, inv its inverse)."""
    return jnp.take(x, perm, axis=0)


def _permute_fwd(x, perm, inv):
    return _permute(x, perm, inv), (perm, inv)


def _permute_bwd(res, g):
    perm, inv = res
    return jnp.take(g, inv, axis=0), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _combine(ys, order, inv, scores):
    """Each token's k expert outputs (rows `ys` [N*k, D] in the pairs' sorted `order`) weighted by its scores."""
    n, k = scores.shape
    y_nkd = _permute(ys, inv, order).reshape(n, k, ys.shape[-1])  # back to (token, slot) order
    return jnp.einsum(
        "nkd,nk->nd", y_nkd, scores.astype(ys.dtype), preferred_element_type=jnp.float32
    ).astype(ys.dtype)


def _experts_local(
    x_nd,
    topk_idx,
    scores,
    gate_up,
    down,
    adapters=None,
    *,
    impl,
    expert_offset=0,
    all_local=True,
    lora_scale=0.0,
):
    """Dropless expert MLP of N tokens on the experts [expert_offset, expert_offset + E_local) held here.

    Pairs routed to other experts are sorted past the local groups: the grouped matmul leaves them zero.
    `adapters`: the per-expert LoRA (gate_up A [E, D, 2, r], B [E, 2, r, I], down A [E, I, r], B [E, r, D];
    models/lora.py), applied as s·(x·A)·B by grouped matmuls of their own.
    """
    k = topk_idx.shape[1]
    e_local = gate_up.shape[0]
    local = topk_idx - expert_offset  # [N, k]
    in_range = (local >= 0) & (local < e_local)
    key = jnp.where(in_range, local, e_local).reshape(-1)  # non-local pairs sort last
    order, inv = sort_pairs(key)
    group_sizes = jnp.bincount(key, length=e_local + 1)[:e_local].astype(jnp.int32)
    xs = _dispatch(x_nd, order, inv, k)  # [N*k, D], sorted by expert
    ys = expert_mlp(
        xs, group_sizes, gate_up, down, adapters, impl=impl, full=all_local, lora_scale=lora_scale
    )  # every pair has a local expert when all_local: the groups cover all rows
    return _combine(ys, order, inv, scores)


def experts_forward(
    x_nd,
    route_out: RouterOut,
    gate_up,
    down,
    impl: str,
    mode: str,
    adapters=None,
    lora_scale: float = 0.0,
    a2a_impl: str = "auto",
    a2a_capacity_factor: float = A2A_CAPACITY_FACTOR,
    keep_gathered: bool = False,
) -> jax.Array:
    """The sparse block's output [N, D] for tokens x [N, D] with routing `route_out` (and per-expert
    `adapters`, split over devices like the experts); `a2a_impl` and `a2a_capacity_factor` set
    mode "a2a"'s exchange (moe_a2a.py). `keep_gathered` (mode "fsdp"): the experts are gathered under the name
    EXPERTS_GATHERED, which the layer's remat policy then saves (ModelConfig.keep_gathered_experts)."""
    extra = () if adapters is None else (adapters,)
    mesh = current_mesh()
    # The tokens are a [B, T] batch flattened: rows split over (data, fsdp), a row's tokens over context, so
    # the flat axis is split over all three in that order. Specifying fewer axes would make the shard_map
    # gather the tokens over the others and run every expert MLP on each of their devices (C-fold under
    # context parallelism).
    tok_axes = None if mesh is None else logical_to_spec(("batch_context",), x_nd.shape, mesh)[0]
    if tok_axes is None:
        return _experts_local(
            x_nd,
            route_out.topk_idx,
            route_out.scores,
            gate_up,
            down,
            *extra,
            impl=impl,
            lora_scale=lora_scale,
        )
    tok = P(tok_axes, None)
    n_ep = mesh.shape[EP_AXIS]
    if mode == "fsdp" or n_ep == 1:
        if keep_gathered:  # gathered here, by name, rather than by the shard_map's replicated in_specs
            gate_up, down = (
                checkpoint_name(jax.lax.with_sharding_constraint(w, P()), EXPERTS_GATHERED)
                for w in (gate_up, down)
            )
        fn = functools.partial(_experts_local, impl=impl, lora_scale=lora_scale)
        specs = (tok, tok, tok, P(), P(), *[P()] * len(extra))
        return jax.shard_map(fn, in_specs=specs, out_specs=tok, check_vma=False)(
            x_nd, route_out.topk_idx, route_out.scores, gate_up, down, *extra
        )
    if gate_up.shape[0] % n_ep:
        raise ValueError(
            f"expert_parallel={mode!r}: {gate_up.shape[0]} experts do not split over {EP_AXIS}={n_ep}"
        )
    e_local = gate_up.shape[0] // n_ep
    if EP_AXIS not in (tok_axes if isinstance(tok_axes, tuple) else (tok_axes,)):
        raise ValueError(f"expert_parallel={mode!r} needs the token batch split over the {EP_AXIS} axis")
    ex = P(EP_AXIS)
    specs = (tok, tok, tok, ex, ex, *[ex] * len(extra))
    if mode == "a2a":
        from primejax.models import moe_a2a

        fn = functools.partial(
            moe_a2a.experts_a2a, axis=EP_AXIS, impl=impl, exchange=moe_a2a.resolve_a2a(a2a_impl),
            lora_scale=lora_scale, capacity_factor=a2a_capacity_factor,
        )  # fmt: skip
        return jax.shard_map(fn, in_specs=specs, out_specs=tok, check_vma=False)(
            x_nd, route_out.topk_idx, route_out.scores, gate_up, down, *extra
        )

    def ep(x, idx, sc, gu, dn, *ad):
        # All tokens of the fsdp group, each device's experts on them, partial sums scattered back.
        xg = jax.lax.all_gather(x, EP_AXIS, tiled=True)
        ig = jax.lax.all_gather(idx, EP_AXIS, tiled=True)
        sg = jax.lax.all_gather(sc, EP_AXIS, tiled=True)
        off = jax.lax.axis_index(EP_AXIS) * e_local
        y = _experts_local(
            xg, ig, sg, gu, dn, *ad, impl=impl, expert_offset=off, all_local=False, lora_scale=lora_scale
        )
        return jax.lax.psum_scatter(y, EP_AXIS, scatter_dimension=0, tiled=True)

    return jax.shard_map(ep, in_specs=specs, out_specs=tok, check_vma=False)(
        x_nd, route_out.topk_idx, route_out.scores, gate_up, down, *extra
    )


def moe_block(
    h_btd: jax.Array,
    p: dict[str, jax.Array],
    *,
    top_k: int,
    norm_topk_prob: bool,
    impl: str,
    mode: str,
    replay_idx: jax.Array | None = None,
    replay_mask: jax.Array | None = None,
    scoring: str = "softmax",
    n_group: int = 1,
    topk_group: int = 1,
    scale: float = 1.0,
    lora_scale: float = 0.0,
    a2a_impl: str = "auto",
    a2a_capacity_factor: float = A2A_CAPACITY_FACTOR,
    keep_gathered_experts: bool = False,
) -> tuple[jax.Array, RouterOut]:
    """Sparse MLP of a normed hidden state [B, T, D] -> ([B, T, D], routing of the B*T tokens).

    `p` holds one sparse layer's router, experts and, when present, `router_bias` [E] (the sigmoid router's
    correction bias) and the shared experts `shared_gate_proj`/`shared_up_proj` [D, Fs], `shared_down_proj`
    [Fs, D] (with Qwen3.5 MoE's `shared_expert_gate` [D]); LoRA adapters of the router and experts (models/lora.py) scaled by `lora_scale`.
    """
    from primejax.models import lora

    b, t, d = h_btd.shape
    dt = h_btd.dtype
    x = h_btd.reshape(b * t, d)
    ri = None if replay_idx is None else replay_idx.reshape(b * t, top_k)
    rm = None if replay_mask is None else replay_mask.reshape(b * t)
    r = route(
        x,
        lora.router_weight(p, lora_scale),
        top_k,
        norm_topk_prob,
        ri,
        rm,
        scoring=scoring,
        bias_e=p.get("router_bias"),
        n_group=n_group,
        topk_group=topk_group,
        scale=scale,
    )
    # HF casts the combine weights to the hidden dtype before weighting the experts' outputs.
    r_used = r._replace(scores=r.scores.astype(dt))
    y = experts_forward(
        x, r_used, p["experts_gate_up"].astype(dt), p["experts_down"].astype(dt), impl, mode,
        lora.expert_adapters(p, dt), lora_scale, a2a_impl, a2a_capacity_factor, keep_gathered_experts,
    )  # fmt: skip
    y_btd = y.reshape(b, t, d)
    if "shared_gate_proj" in p:
        g_btf = jnp.einsum("btd,df->btf", h_btd, p["shared_gate_proj"].astype(dt))
        u_btf = jnp.einsum("btd,df->btf", h_btd, p["shared_up_proj"].astype(dt))
        a_btf = constrain(jax.nn.silu(g_btf) * u_btf, ("batch", "seq", "act_mlp"))
        s_btd = jnp.einsum("btf,fd->btd", a_btf, p["shared_down_proj"].astype(dt))
        if "shared_expert_gate" in p:  # Qwen3.5 MoE: a per-token sigmoid gate on the shared expert
            s_btd = (
                s_btd
                * jax.nn.sigmoid(jnp.einsum("btd,d->bt", h_btd, p["shared_expert_gate"].astype(dt)))[
                    ..., None
                ]
            )
        y_btd = y_btd + s_btd
    return y_btd, r


# ---------------------------------------------------------------------- statistics and auxiliary losses


def expert_load(topk_idx: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """[E] float32: (token, expert) pairs routed to each expert over the valid tokens."""
    k = topk_idx.shape[-1]
    w = jnp.repeat(valid.reshape(-1).astype(jnp.float32), k)
    return jnp.zeros((num_experts,), jnp.float32).at[topk_idx.reshape(-1)].add(w)


def max_violation(load: jax.Array) -> jax.Array:
    """(max load - mean load) / mean load; 0 for perfect balance, E - 1 when one expert takes everything."""
    mean = jnp.mean(load, axis=-1)
    return (jnp.max(load, axis=-1) - mean) / jnp.maximum(mean, 1e-9)


def router_partials(r: RouterOut, valid: jax.Array, num_experts: int) -> dict[str, jax.Array]:
    """One layer's routing statistics as sums per token shard, [S, ...] (S: the devices the B*T tokens are
    split over, 1 without a mesh): (token, expert) pairs per expert, router probabilities per expert, valid
    tokens, and squared router logsumexps. `router_stats` combines the shards of every layer at once, after
    the layers: summed over the whole batch here, each layer of the scan held an all-reduce of its own
    (2E + 2 floats) in the collective queue before its experts' gather (docs/moe.md)."""

    def local(topk_idx, probs, logits, v):
        v = v.astype(jnp.float32)
        z = jax.nn.logsumexp(logits, axis=-1)
        sums = {
            "load": expert_load(topk_idx, v, num_experts),
            "probs": jnp.sum(probs * v[:, None], axis=0),
            "tokens": jnp.sum(v),
            "z": jnp.sum(z * z * v),
        }
        return {k: x[None] for k, x in sums.items()}

    args = (r.topk_idx, r.probs, r.logits, valid.reshape(-1))
    mesh = current_mesh()
    tok_axes = None if mesh is None else logical_to_spec(("batch_context",), args[-1].shape, mesh)[0]
    if tok_axes is None:
        return local(*args)
    tok = P(tok_axes)
    return jax.shard_map(local, in_specs=(tok,) * 4, out_specs=tok, check_vma=False)(*args)


def router_stats(parts: dict[str, jax.Array], num_experts: int) -> dict[str, jax.Array]:
    """Per layer, from `router_partials` stacked [L, S, ...], over the whole batch: the expert load [L, E], the
    Switch-style load-balancing loss [L] (as transformers' load_balancing_loss_func for one layer:
    E * sum_e f_e * P_e, f_e the fraction of valid tokens with e among their top-k, P_e the mean router
    probability) and the ST-MoE router z-loss [L] (mean over valid tokens of logsumexp(logits)^2)."""
    s = {k: jnp.sum(x, axis=1) for k, x in parts.items()}
    n = jnp.maximum(s["tokens"], 1.0)
    f, p_mean = s["load"] / n[:, None], s["probs"] / n[:, None]
    return {"load": s["load"], "lb_loss": num_experts * jnp.sum(f * p_mean, axis=-1), "z_loss": s["z"] / n}
