"""MoE pieces against plain references: grouped matmul (values, gradients, skewed / empty experts), the dropless
expert block vs a dense one-hot mixture, routing replay's gradient, load metrics and the auxiliary losses
(vs transformers' load_balancing_loss_func)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from primejax.models import moe
from primejax.models.config import ModelConfig
from primejax.models.gmm import grouped_matmul


def _ref_gmm(x, w, sizes):
    out, start = [], 0
    for g, n in enumerate(sizes):
        out.append(x[start : start + n] @ w[g])
        start += n
    out.append(np.zeros((x.shape[0] - start, w.shape[-1]), x.dtype))
    return np.concatenate(out)


@pytest.mark.parametrize("sizes", [[5, 9, 3, 7], [0, 24, 0, 0], [6, 0, 0, 12], [3, 4, 0, 5]])
def test_grouped_matmul_matches_per_group_matmuls_and_grads(sizes):
    """Uniform, one expert taking everything, empty experts, and rows past sum(sizes) (left zero)."""
    rng = np.random.default_rng(0)
    m, k, n = 24, 16, 8
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((4, k, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    y = grouped_matmul(jnp.asarray(x), jnp.asarray(w), gs, "xla")
    np.testing.assert_allclose(np.asarray(y), _ref_gmm(x, w, sizes), rtol=1e-5, atol=1e-5)

    def loss(x, w):
        return jnp.sum(grouped_matmul(x, w, gs, "xla") * dy)

    gx, gw = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    # reference gradients: dX rows = dY @ W[g]^T, dW[g] = X_g^T dY_g (zero for an empty group)
    rgx = _ref_gmm(dy, np.swapaxes(w, 1, 2), sizes)
    rgw, start = np.zeros_like(w), 0
    for g, cnt in enumerate(sizes):
        rgw[g] = x[start : start + cnt].T @ dy[start : start + cnt]
        start += cnt
    np.testing.assert_allclose(np.asarray(gx), rgx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), rgw, rtol=1e-5, atol=1e-5)


def _unwritten_kernels(monkeypatch):
    """Stand-ins for the Mosaic kernels with their contract on rows past sum(group_sizes): the forward leaves
    them unwritten (NaN here: what a reused buffer may hold), the weight gradient reads group rows through a
    product mask (as the kernel masks a block's rows of other groups), so a NaN it is handed there spreads."""
    from primejax.models import gmm

    def fwd(lhs, rhs, group_sizes, transpose_rhs):
        out = jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, group_sizes)
        rows = jnp.arange(lhs.shape[0])[:, None]
        return jnp.where(rows < jnp.sum(group_sizes), out, jnp.nan)

    def wgrad(lhs, dout, group_sizes):
        ends = jnp.cumsum(group_sizes)
        rows = jnp.arange(lhs.shape[0])
        mask = ((rows[None] >= (ends - group_sizes)[:, None]) & (rows[None] < ends[:, None])).astype(
            lhs.dtype
        )
        return jnp.einsum("gm,mk,mn->gkn", mask, lhs, dout)

    monkeypatch.setattr(gmm, "_fwd_kernel", fwd)
    monkeypatch.setattr(gmm, "_wgrad_kernel", wgrad)
    return gmm


@pytest.mark.parametrize("sizes", [[5, 9, 3, 7], [3, 4, 0, 5], [0, 0, 0, 0]])
def test_mosaic_grouped_matmul_drops_the_rows_its_kernels_leave_unwritten(sizes, monkeypatch):
    """The mgpu path's wrapper around kernels that leave rows past the groups unwritten: an expert MLP
    (grouped matmul, SwiGLU, grouped matmul) gives the xla path's outputs and gradients, all finite, with rows
    past the groups zero. Without the selects the NaN reaches the weight gradient through its product mask."""
    gmm = _unwritten_kernels(monkeypatch)
    rng = np.random.default_rng(1)
    m, d, i = 24, 16, 8
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((4, d, 2 * i)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((4, i, d)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)

    def mlp(x, w1, w2, impl):
        h = grouped_matmul(x, w1, gs, impl)
        return grouped_matmul(jax.nn.silu(h[:, :i]) * h[:, i:], w2, gs, impl)

    def loss(x, w1, w2, impl):
        return jnp.sum(jnp.sin(mlp(x, w1, w2, impl)))

    y = mlp(x, w1, w2, "mgpu")
    assert bool(jnp.all(jnp.isfinite(y))) and not bool(jnp.any(y[sum(sizes) :]))
    np.testing.assert_allclose(np.asarray(y), np.asarray(mlp(x, w1, w2, "xla")), rtol=1e-5, atol=1e-5)
    got = jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2, "mgpu")
    want = jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2, "xla")
    for a, b in zip(got, want, strict=True):
        assert bool(jnp.all(jnp.isfinite(a)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert gmm.resolve_impl("mgpu") == "mgpu"


def _dense_mixture(x, topk_idx, scores, gate_up, down):
    """Every expert on every token, combined with one-hot routing weights (the definition of the block)."""
    e = gate_up.shape[0]
    h = jnp.einsum("nd,edgi->negi", x, gate_up)
    a = jax.nn.silu(h[:, :, 0]) * h[:, :, 1]
    y = jnp.einsum("nei,eid->ned", a, down)
    comb = jnp.sum(jax.nn.one_hot(topk_idx, e) * scores[..., None], axis=1)  # [N, E]
    return jnp.einsum("ned,ne->nd", y, comb)


@pytest.mark.parametrize("skew", [False, True])
def test_dropless_block_equals_dense_mixture_with_grads(skew):
    rng = np.random.default_rng(1)
    n, d, e, i, k = 20, 16, 6, 8, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((d, e)), jnp.float32)
    if skew:  # expert 2 first choice of every token, experts 4 and 5 never used
        router = (0.1 * router).at[0, 2].set(10.0).at[0, 4:].set(-10.0)
        x = x.at[:, 0].set(5.0)
    gate_up = jnp.asarray(rng.standard_normal((e, d, 2, i)) * 0.3, jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, i, d)) * 0.3, jnp.float32)

    def ours(x, router, gate_up, down):
        r = moe.route(x, router, k, True)
        return moe.experts_forward(x, r, gate_up, down, "xla", "fsdp"), r

    def ref(x, router, gate_up, down):
        r = moe.route(x, router, k, True)
        return _dense_mixture(x, r.topk_idx, r.scores, gate_up, down)

    y, r = ours(x, router, gate_up, down)
    if skew:
        load = np.asarray(moe.expert_load(r.topk_idx, jnp.ones(n, bool), e))
        assert load[2] == n and load[4] == load[5] == 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref(x, router, gate_up, down)), rtol=1e-5, atol=1e-5)
    w = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    g1 = jax.grad(lambda *a: jnp.sum(ours(*a)[0] * w), argnums=(0, 1, 2, 3))(x, router, gate_up, down)
    g2 = jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums=(0, 1, 2, 3))(x, router, gate_up, down)
    for a, b, name in zip(g1, g2, ("x", "router", "gate_up", "down"), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=name)


def test_routing_replay_uses_recorded_experts_and_router_gets_gradient():
    rng = np.random.default_rng(2)
    n, d, e, k = 6, 8, 5, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((d, e)), jnp.float32)
    free = moe.route(x, router, k, True)
    # record experts the router would not pick: its two least likely ones
    recorded = jnp.argsort(free.probs, axis=-1)[:, :k].astype(jnp.int32)
    mask = jnp.asarray([True, True, True, False, False, True])
    r = moe.route(x, router, k, True, recorded, mask)
    m = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(r.topk_idx)[m], np.asarray(recorded)[m])
    np.testing.assert_array_equal(np.asarray(r.topk_idx)[~m], np.asarray(free.topk_idx)[~m])
    gathered = np.take_along_axis(np.asarray(free.probs), np.asarray(recorded), axis=-1)
    np.testing.assert_allclose(
        np.asarray(r.scores)[m], (gathered / gathered.sum(-1, keepdims=True))[m], rtol=1e-6
    )

    # the router's gradient flows through the gathered scores of replayed tokens
    g = jax.grad(lambda w: jnp.sum(moe.route(x, w, k, False, recorded, jnp.ones(n, bool)).scores[:, 0]))(
        router
    )
    assert float(jnp.abs(g).max()) > 1e-4


def test_max_violation_and_aux_losses():
    np.testing.assert_allclose(float(moe.max_violation(jnp.asarray([2.0, 2.0, 2.0, 2.0]))), 0.0)
    np.testing.assert_allclose(float(moe.max_violation(jnp.asarray([8.0, 0.0, 0.0, 0.0]))), 3.0)
    np.testing.assert_allclose(float(moe.max_violation(jnp.asarray([3.0, 1.0, 2.0, 2.0]))), 0.5)

    rng = np.random.default_rng(3)
    n, d, e, k = 32, 8, 6, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((d, e)), jnp.float32)
    r = moe.route(x, router, k, False)
    valid = jnp.ones(n, bool)
    # one layer's statistics the way the model computes them: per-shard sums, combined over a stack of layers
    stats = moe.router_stats(jax.tree.map(lambda a: a[None], moe.router_partials(r, valid, e)), e)
    ours = float(stats["lb_loss"][0])
    theirs = float(load_balancing_loss_func((torch.as_tensor(np.array(r.logits)),), e, k))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    z = np.log(np.exp(np.asarray(r.logits, np.float64)).sum(-1))
    np.testing.assert_allclose(float(stats["z_loss"][0]), np.mean(z * z), rtol=1e-5)
    # padding tokens do not count
    half = jnp.arange(n) < n // 2
    load = np.asarray(moe.expert_load(r.topk_idx, half, e))
    assert load.sum() == n // 2 * k


def _cfg(**kw):
    base = dict(
        model_type="qwen3_moe",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        rope_theta=1e4,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qk_norm=True,
        attention_bias=False,
        max_position_embeddings=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    return ModelConfig(**{**base, **kw})


def test_moe_config_layers_and_errors():
    assert _cfg().sparse_layers() == (0, 1, 2, 3)
    assert _cfg(decoder_sparse_step=2).sparse_layers() == (1, 3)
    assert _cfg(mlp_only_layers=(0, 3)).dense_layers() == (0, 3)
    assert _cfg(num_experts=0, model_type="qwen3").sparse_layers() == ()
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _cfg(num_experts_per_tok=5)
    with pytest.raises(ValueError, match="at most 256"):
        _cfg(num_experts=300)
    with pytest.raises(ValueError, match="gmm_impl"):
        _cfg(gmm_impl="cuda")
    with pytest.raises(ValueError, match="scan_layers"):
        _cfg(mlp_only_layers=(0,), scan_layers=True)
    # active parameters: top-k experts + router per sparse layer
    c = _cfg()
    dense_equiv = (
        c.num_layers * (32 * 2 * 32 * 2 + 2 * 32 * 1 * 32) + 4 * (3 * 32 * 16 * 2 + 32 * 4) + 32 * 64
    )
    assert c.num_matmul_params() == dense_equiv


def _count_prims(jaxpr, name: str) -> int:
    """Occurrences of primitive `name` in a jaxpr and every jaxpr nested in its equations (each reference)."""
    from jax.extend.core import jaxprs_in_params

    return sum(
        (eqn.primitive.name == name) + sum(_count_prims(sub, name) for sub in jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )


# The scanned stack is the extended tier (PRIMEJAX_SLOW=1): the same policy check, the default tier runs it unrolled.
@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_weight_dots_policy_keeps_the_grouped_matmul_outputs(scan):
    """Under remat "dots_no_batch_attn" (the auto policy up to 32k tokens) the backward pass reuses the experts'
    grouped-matmul outputs: as many grouped matmuls in the gradient as without remat; "full" re-runs them.
    "attn_experts_offload" brings the gate/up output back from host memory (one fewer re-run per layer) and gives
    the gradients of no remat."""
    from flax import nnx

    from primejax.models.transformer import init_model

    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (1, 16)), jnp.int32)
    pos = jnp.arange(16, dtype=jnp.int32)[None]
    seg = jnp.ones((1, 16), jnp.int32)
    counts, grads, puts = {}, {}, {}
    for policy in ("none", "dots_no_batch_attn", "full", "attn_experts_offload"):
        model = init_model(_cfg(remat_policy=policy, scan_layers=scan, gmm_impl="xla"), None, seed=0)
        graphdef, params = nnx.split(model)

        def loss(p, graphdef=graphdef):
            return jnp.sum(nnx.merge(graphdef, p)(tokens, pos, seg).astype(jnp.float32) ** 2)

        jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
        counts[policy] = _count_prims(jaxpr, "ragged_dot_general")
        puts[policy] = _count_prims(jaxpr, "device_put")  # the offload's copies out and back
        if policy in (
            "none",
            "attn_experts_offload",
        ):  # values in fp32: bf16 recompute differs by its rounding
            cfg = _cfg(remat_policy=policy, scan_layers=scan, gmm_impl="xla", compute_dtype="float32")
            graphdef, params = nnx.split(init_model(cfg, None, seed=0))
            grads[policy] = jax.jit(jax.grad(functools.partial(loss, graphdef=graphdef)))(params)
    assert counts["none"] > 0
    assert counts["dots_no_batch_attn"] == counts["none"]
    assert counts["full"] > counts["none"]
    # the gate/up output comes back from host memory: one grouped matmul per layer fewer re-run than `full`
    layers = _cfg().num_layers
    assert counts["attn_experts_offload"] == counts["full"] - (1 if scan else layers)
    assert puts["attn_experts_offload"] == 2 * (1 if scan else layers) and puts["dots_no_batch_attn"] == 0
    ref, got = jax.tree.leaves(grads["none"]), jax.tree.leaves(grads["attn_experts_offload"])
    err = max(float(jnp.abs(a - b).max()) for a, b in zip(ref, got, strict=True))
    scale = max(float(jnp.abs(a).max()) for a in ref)
    assert err <= 1e-5 * scale, (
        err,
        scale,
    )  # any remat reorders fp32 sums: `full` is 1.3e-6 of the scale here


def test_scan_unroll_gives_the_one_layer_scan_results():
    """Two layers per scan iteration (scan_unroll=2) over 4 layers, a remat policy on: the same loss and
    gradients as one layer per iteration; 0 is refused."""
    from flax import nnx

    from primejax.models.transformer import init_model

    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (1, 16)), jnp.int32)
    pos = jnp.arange(16, dtype=jnp.int32)[None]
    seg = jnp.ones((1, 16), jnp.int32)
    out = {}
    for unroll in (1, 2):
        cfg = _cfg(
            scan_layers=True, scan_unroll=unroll, remat_policy="full", gmm_impl="xla", compute_dtype="float32"
        )
        graphdef, params = nnx.split(init_model(cfg, None, seed=0))

        def loss(p, graphdef=graphdef):
            return jnp.sum(nnx.merge(graphdef, p)(tokens, pos, seg).astype(jnp.float32) ** 2)

        out[unroll] = jax.jit(jax.value_and_grad(loss))(params)
    (l1, g1), (l2, g2) = out[1], out[2]
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(
            np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6 * float(jnp.abs(a).max())
        )
    with pytest.raises(ValueError, match="scan_unroll"):
        _cfg(scan_layers=True, scan_unroll=0)


def test_grouped_matmul_tile_table_fits_the_kernels():
    """Every measured tile entry tiles its shape (the Mosaic kernels' divisibility rules) and fits shared memory;
    unknown shapes get the default tiles."""
    from primejax.models import gmm

    smem_limit = 227 * 1024
    for (op, k, n), t in gmm.MEASURED_TILES.items():
        assert k % t["block_k"] == 0, (op, k, n)
        assert n % (t["block_n"] * t["grid_block_n"]) == 0, (op, k, n)
        if op == "wgrad":  # the transposed kernel tiles the output's K rows by block_m
            assert k % t["block_m"] == 0, (op, k, n)
        smem = t["max_concurrent_steps"] * (t["block_m"] + t["block_n"]) * t["block_k"] * 2
        assert smem + t["block_m"] * t["block_n"] * 2 <= smem_limit, (op, k, n)
        assert gmm.tiles_for(op, k, n) == t
    assert gmm.tiles_for("fwd", 64, 64) == gmm.DEFAULT_TILES


def test_adapter_factors_padded_to_the_kernel_tiles_keep_their_product_and_grads():
    """A rank-r LoRA factor goes to the Mosaic kernels with its rank zero-padded to their tiles (XLA's ragged_dot
    is dense on GPU); the padded product's first N columns and both gradients equal the unpadded ones, for the
    rank as N (x·A) and as K ((x·A)·B). The padded shapes tile the default tiles."""
    from primejax.models import gmm

    rng = np.random.default_rng(3)
    sizes = jnp.asarray([5, 0, 7, 4], jnp.int32)  # 16 of 20 rows grouped: the rest must stay zero
    for k, n in ((96, 16), (16, 80)):
        x = jnp.asarray(rng.standard_normal((20, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((4, k, n)), jnp.float32)
        dy = jnp.asarray(rng.standard_normal((20, n)), jnp.float32)

        def padded(x, w, k=k, n=n):
            xp, wp = gmm.pad_to_tiles(x, w, gmm.ADAPTER_TILE)
            assert (
                xp.shape[1] % gmm.DEFAULT_TILES["block_k"] == 0
                and wp.shape[2] % gmm.DEFAULT_TILES["block_n"] == 0
            )
            return grouped_matmul(xp, wp, sizes, "xla")[:, :n]

        def plain(x, w):
            return grouped_matmul(x, w, sizes, "xla")

        for f in (padded, plain):
            assert f(x, w).shape == (20, n)
        # equal up to fp32 summation order (the zero pad changes XLA:CPU's blocking of the contraction)
        np.testing.assert_allclose(padded(x, w), plain(x, w), rtol=1e-5, atol=1e-5)
        g_pad = jax.grad(lambda x, w, dy=dy: jnp.sum(padded(x, w) * dy), argnums=(0, 1))(x, w)
        g_ref = jax.grad(lambda x, w, dy=dy: jnp.sum(plain(x, w) * dy), argnums=(0, 1))(x, w)
        for a, b in zip(g_pad, g_ref, strict=True):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert gmm.adapter_grouped_matmul(x, w, sizes, "xla").shape == (20, 80)  # no padding off Hopper


def test_a2a_slots_bound_the_rounds():
    """All-to-all slots (tokens per peer and round): the worst case N at factor <= 0; else the factor times the
    balanced share N x hit_fraction, never more than MAX_ROUNDS rounds (each is compiled into the layer) and
    never more than N. Round 0's pair window: the factor times N*k, at most what its receive buffer holds."""
    from primejax.models.moe_a2a import MAX_ROUNDS, capacity, hit_fraction, pair_window

    n, k = 16384, 8
    # Qwen3-30B-A3B (128 experts, top 8) on 4 devices: the chance a token has none of a device's 32 experts is
    # C(96, 8) / C(128, 8), so 3.62 of the 4 devices receive it, against 8 (token, expert) pairs
    miss = math.comb(96, 8) / math.comb(128, 8)
    assert hit_fraction(k, 32, 4) == pytest.approx(1 - miss, rel=1e-12)
    assert 4 * hit_fraction(k, 32, 4) == pytest.approx(3.62, abs=0.01)
    assert hit_fraction(k, 1, 8) == 1.0 and hit_fraction(1, 32, 4) == pytest.approx(0.25)
    assert capacity(n, k, 32, 4, 0.0) == n  # worst case: every token to every peer, one round
    assert capacity(n, k, 32, 4, 1.5) == n  # 1.5 x 0.905 N is past N: one round whatever the routing
    assert pair_window(n, k, 32, 4, 1.5) == 1.5 * n * k and pair_window(n, k, 32, 4, 0.0) == 4 * n * k
    # 64 devices with 2 experts each: 12% of a device's tokens visit each peer, 1.5 x that a round: 6 rounds
    assert capacity(4096, k, 2, 64, 1.5) == 752 and -(-4096 // 752) == 6
    c = capacity(4096, 2, 2, 64, 1.5)  # top 2: 3% visit each peer; 1.5 x share would take 22 rounds
    assert c == 4096 // MAX_ROUNDS and c % 8 == 0  # the floor: MAX_ROUNDS rounds
    assert capacity(4096, k, 8, 16, 1.5) == 2536  # 16 devices with 8 experts each: 41% visit each peer


def test_a2a_mlp_ranges_are_halves_of_a_balanced_load():
    """Round 0's expert MLP ranges (the grouped matmul's work is its static row count): halves of a balanced
    load over the window, so a device with a balanced load runs two and skips the rest; a device whose pairs
    end anywhere in the window runs rows within half a balanced load of them."""
    from primejax.models.moe_a2a import mlp_ranges, pair_window

    n, k = 16384, 8
    window, balanced = pair_window(n, k, 32, 4, 1.5), n * k
    ranges = mlp_ranges(window, balanced)
    assert ranges == (0, balanced // 2, balanced) and window == balanced * 3 // 2
    spans = list(zip(ranges, (*ranges[1:], window), strict=True))
    for pairs in range(1, window + 1, 997):
        run = sum(hi - lo for lo, hi in spans if pairs > lo)  # the ranges a device's pairs reach
        assert pairs <= run < pairs + balanced // 2
    assert sum(hi - lo for lo, hi in spans if balanced >= lo + 1) == balanced
    assert mlp_ranges(96, 64) == (0, 32, 64)  # tiny loads: ranges of at least 8 rows
