"""Run in a subprocess by test_moe_mesh.py with 8 emulated CPU devices (XLA flags must precede jax's start).

Usage: python moe_mesh_check.py HF_DIR OUT_JSON [CASE,CASE...]. For each expert-parallel mode and mesh, the logits, loss and
every parameter gradient of a tiny Qwen3-MoE against the single-device values, and the experts' sharding.
Then routing replay through the trainer's gradient function (trainer.step: a batch's routed experts ->
replay_inputs -> moe.route) on FSDP, expert-parallel and context-parallel meshes against one device, with
recorded experts that differ from the router's own choice (and the same batch routed freely, to show it).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from primejax.contracts.batch import TrainingSample, pack_samples
from primejax.models import moe, moe_a2a
from primejax.models.hf_io import load_model
from primejax.models.sharding import make_mesh
from primejax.trainer.config import LossConfig
from primejax.trainer.hlo_collectives import collective_bytes
from primejax.trainer.losses import global_counts, make_loss_fn
from primejax.trainer.step import _micro_loss_fn, _shift_left, device_batch, shift_targets, to_micro_batches

CASES = {
    "fsdp@fsdp8": ("fsdp", dict(fsdp=8)),
    "ep@fsdp8": ("ep", dict(fsdp=8)),
    "ep@data2_fsdp4": ("ep", dict(data=2, fsdp=4)),
    "fsdp@data2_fsdp2_tensor2": ("fsdp", dict(data=2, fsdp=2, tensor=2)),
    # all-to-all expert parallelism: the padded exchange, and the ragged one's offsets through
    # moe_a2a.ragged_all_to_all_reference (XLA:CPU has no ragged-all-to-all)
    "a2a@fsdp8": ("a2a", dict(fsdp=8)),
    "a2a:ragged@data2_fsdp4": ("a2a:ragged", dict(data=2, fsdp=4)),
}
# Routing replay: (expert_parallel mode, mesh, scan_layers). Both modes' shard_map paths, with and without
# the context split of each row's tokens (trainer.mesh.context), one without fsdp (experts not split: the
# tokens alone are), the last through the scanned layer stack.
REPLAY_CASES = {
    "fsdp@fsdp8": ("fsdp", dict(fsdp=8), False),
    "ep@data2_fsdp4": ("ep", dict(data=2, fsdp=4), False),
    "fsdp@data2_context4": ("fsdp", dict(data=2, fsdp=1, context=4), False),
    "ep@fsdp2_context4_scan": ("ep", dict(fsdp=2, context=4), True),
    "a2a@fsdp2_context4_scan": ("a2a", dict(fsdp=2, context=4), True),
    "a2a:ragged@data2_fsdp4": ("a2a:ragged", dict(data=2, fsdp=4), False),
}
REPLAY_SEQ, REPLAY_ROWS = 32, 8
REPLAY_LOSS = LossConfig(kl_tau=0.1, moe_aux_coef=0.01, moe_z_coef=0.001)


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, size=(8, 16), dtype=np.int32)
    positions = np.tile(np.arange(16, dtype=np.int32), (8, 1))
    segments = np.ones((8, 16), np.int32)
    segments[1, 12:] = 0  # padding must not count in the expert load
    return tokens, positions, segments


def _loss_and_grads(model, tokens, positions, segments):
    graphdef, params = nnx.split(model)

    def loss(p):
        m = nnx.merge(graphdef, p)
        h, stats = m.forward_with_aux(tokens, positions, segments)
        logits = jnp.einsum("btd,dv->btv", h, m.lm_head_weight())
        lp = jax.nn.log_softmax(logits, -1)
        ce = -jnp.mean(jnp.take_along_axis(lp[:, :-1], tokens[:, 1:, None], -1))
        return ce + 0.01 * jnp.sum(stats["lb_loss"]) + 0.001 * jnp.sum(stats["z_loss"]), (
            logits,
            stats["load"],
        )

    (val, (logits, load)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    flat = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(grads)}
    return float(val), np.asarray(logits), np.asarray(load), flat


def _replay_batch(cfg) -> dict[str, np.ndarray]:
    """One micro-batch of packed rows whose completion tokens carry random recorded experts (prompts route
    freely); segments straddle the 8-token shards of a 4-way context split."""
    rng = np.random.default_rng(5)
    layers, k, e = len(cfg.sparse_layers()), cfg.num_experts_per_tok, cfg.num_experts
    samples = []
    for _ in range(9):
        n, p = int(rng.integers(8, 31)), int(rng.integers(2, 6))
        experts = np.argsort(rng.random((n, layers, e)), axis=-1)[..., :k].astype(np.uint8)
        samples.append(
            TrainingSample(
                token_ids=rng.integers(0, cfg.vocab_size, n).tolist(),
                loss_mask=[False] * p + [True] * (n - p),
                inference_logprobs=[0.0] * p + list(-np.log(cfg.vocab_size) + rng.normal(0, 0.3, n - p)),
                advantages=list(rng.normal(size=n)),
                routed_experts=experts,
                routed_mask=[False] * p + [True] * (n - p),
            )
        )
    (batch,) = pack_samples(samples, seq_len=REPLAY_SEQ, pad_rows_to_multiple=REPLAY_ROWS)
    assert batch.rows == REPLAY_ROWS, batch.rows
    return to_micro_batches(batch, REPLAY_ROWS)  # [1, R, T]: one micro-batch


def _replay_fn(graphdef):
    """The trainer's step on one micro-batch (make_grad_fn's single-micro-batch branch) -> (loss, fp32 grads,
    expert load, every position's logprob): its loss function also hands back the logprobs it scored."""
    loss_fn = make_loss_fn(REPLAY_LOSS)

    def with_logprobs(lp, ent, streams, counts):
        loss, sums = loss_fn(lp, ent, streams, counts)
        return loss, {**sums, "lp": lp}

    grad_fn = jax.value_and_grad(_micro_loss_fn(graphdef, with_logprobs, 16, 0, 0, REPLAY_LOSS), has_aux=True)

    def fn(params, batch):
        mb = {k: v[0] for k, v in batch.items()}
        _, whole = shift_targets(mb)
        (loss, sums), grads = grad_fn(params, mb, global_counts(whole))
        return loss, grads, sums["moe/load"], sums["lp"]

    return jax.jit(fn)


@contextlib.contextmanager
def _expert_tokens(seen: set):
    """Collect the token count each device's expert MLP runs on (moe._experts_local and moe_a2a.experts_a2a
    traced in a shard_map see per-device shapes) while the step traces."""
    local, a2a = moe._experts_local, moe_a2a.experts_a2a

    def spy(fn):
        def run(x_nd, *args, **kwargs):
            seen.add(int(x_nd.shape[0]))
            return fn(x_nd, *args, **kwargs)

        return run

    moe._experts_local, moe_a2a.experts_a2a = spy(local), spy(a2a)
    try:
        yield
    finally:
        moe._experts_local, moe_a2a.experts_a2a = local, a2a


def _mode(mode: str) -> dict:
    """load_model's keywords for a case's mode: "a2a:ragged" is a2a with the ragged exchange (its reference
    stand-in on CPU, installed by `_exchange`)."""
    ep, _, impl = mode.partition(":")
    return dict(expert_parallel=ep, a2a_impl=impl or "auto")


@contextlib.contextmanager
def _exchange(mode: str):
    ragged = moe_a2a.RAGGED_ALL_TO_ALL
    if mode.endswith(":ragged"):
        moe_a2a.RAGGED_ALL_TO_ALL = moe_a2a.ragged_all_to_all_reference
    try:
        yield
    finally:
        moe_a2a.RAGGED_ALL_TO_ALL = ragged


def _replay_run(fn, params, batch, mesh=None) -> dict:
    seen: set[int] = set()
    if mesh is None:
        loss, grads, load, lp = fn(params, batch)
        spec = None
    else:
        with jax.set_mesh(mesh), _expert_tokens(seen):
            dev = device_batch(batch, mesh)
            loss, grads, load, lp = fn(params, dev)
        spec = [list(e) if isinstance(e, tuple) else e for e in dev["routed_experts"].sharding.spec]
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(grads)[0]}
    return dict(
        loss=float(loss), grads=flat, load=np.asarray(load), lp=np.asarray(lp), spec=spec, tokens=sorted(seen)
    )


def _max_rel(got: dict, ref: dict) -> float:
    """Worst element of any gradient against that gradient's largest magnitude."""
    return max(float(np.abs(got[k] - g).max() / max(np.abs(g).max(), 1e-12)) for k, g in ref.items())


def _split(model):
    graphdef, params = nnx.split(model)
    return _replay_fn(graphdef), nnx.to_pure_dict(params)


def _replay(hf_dir: str, only: set[str] | None = None) -> dict:
    dtypes = dict(param_dtype="float32", compute_dtype="float32")
    single, cfg = load_model(hf_dir, **dtypes)
    batch = _replay_batch(cfg)
    fn, params = _split(single)
    ref = _replay_run(fn, params, batch)
    # the same batch with nothing marked for replay (the same compiled function): the router's own choice
    free = _replay_run(fn, params, {**batch, "routed_mask": np.zeros_like(batch["routed_mask"])})
    # position t scores token t + 1 (trainer.step.shift_targets)
    scored = np.asarray(_shift_left(batch["loss_mask"][0], False))
    replayed = scored & np.asarray(_shift_left(batch["routed_mask"][0], False))
    seg, marked = batch["segment_ids"][0], batch["routed_mask"][0]
    # replayed tokens right after a boundary of the 4-way context split: their routing moves to the position
    # before (replay_inputs), which another device holds
    shard = REPLAY_SEQ // 4
    crossing = sum(
        int(((seg[:, b - 1] == seg[:, b]) & marked[:, b]).sum()) for b in range(shard, REPLAY_SEQ, shard)
    )
    out = {
        "replayed_positions": int(replayed.sum()),
        "replays_crossing_context_shards": crossing,
        "free_load_equal": bool(np.array_equal(free["load"], ref["load"])),
        "free_lp_diff": float(np.abs(free["lp"] - ref["lp"])[scored].max()),
        "free_loss_rel": abs(free["loss"] - ref["loss"]) / abs(ref["loss"]),
        "free_grads_max_rel": _max_rel(free["grads"], ref["grads"]),
        "cases": {},
    }
    out["tokens"] = REPLAY_ROWS * REPLAY_SEQ
    for name, (mode, sizes, scan) in REPLAY_CASES.items():
        if only is not None and name not in only:
            continue
        mesh = make_mesh(**sizes)
        model, _ = load_model(hf_dir, mesh=mesh, scan_layers=scan, **_mode(mode), **dtypes)
        with _exchange(mode):
            got = _replay_run(*_split(model), batch, mesh)
        out["cases"][name] = dict(
            loss_rel=abs(got["loss"] - ref["loss"]) / abs(ref["loss"]),
            lp_diff=float(np.abs(got["lp"] - ref["lp"])[scored].max()),
            grads_max_rel=_max_rel(got["grads"], ref["grads"]),
            load_equal=bool(np.array_equal(got["load"], ref["load"])),
            routed_spec=got["spec"],
            expert_tokens_per_device=got["tokens"],
        )
    return out


def _a2a_direct() -> dict:
    """moe.experts_forward with per-expert LoRA adapters, mode a2a (both exchanges) on data=2 x fsdp=4 against
    one device: output and the gradients of x, the scores, the experts and the adapters. Routings: random, and
    every token on device 0's two experts (the worst case: each peer fills its whole slot there, so every
    chunk of device 0's receive buffer runs and the other devices' are all skipped), and top-3 with two of
    them on device 0 (more experts per token than a device holds: a bundle carries fewer pairs than k)."""
    rng = np.random.default_rng(3)
    n, d, e, i, r = 256, 16, 8, 8, 4
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    sc3 = jnp.asarray(rng.random((n, 3)), jnp.float32)
    w = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in [(e, d, 2, i), (e, i, d)]]
    ad = [
        jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
        for s in [(e, d, 2, r), (e, 2, r, i), (e, i, r), (e, r, d)]
    ]
    routings = {
        "random": np.argsort(rng.random((n, e)), -1)[:, :2],
        "all_on_device0": np.tile([1, 0], (n, 1)),
        "top3_two_on_device0": np.tile([1, 0, 2], (n, 1)),
    }

    grad = jax.value_and_grad(_a2a_loss, argnums=(0, 1, 2, 3), has_aux=True)
    fn = jax.jit(grad, static_argnums=(5, 6, 7))
    mesh = make_mesh(data=2, fsdp=4)
    devices, peers = 8, 4  # tokens split over data x fsdp, experts over fsdp
    per_dev, e_local = n // devices, e // peers
    out = {}
    for name, idx in routings.items():
        k = idx.shape[1]
        sc = sc3[:, :k]
        # per device: the most tokens it sends one peer (against a round's slot), and per group of `peers`
        # devices the most (token, expert) pairs one device receives (against round 0's pair window)
        dest = idx.reshape(devices, per_dev, k) // e_local
        sent = np.stack([np.any(dest == q, axis=-1).sum(axis=1) for q in range(peers)], axis=1)  # [dev, peer]
        pairs = np.stack([(dest == q).sum(axis=(1, 2)) for q in range(peers)], axis=1).reshape(
            2, peers, peers
        )
        idx = jnp.asarray(idx, jnp.int32)
        (_, y_ref), g_ref = fn(x, sc, w, ad, idx, "fsdp", "auto", 0.0)  # no mesh: one device
        for exchange in ("padded", "ragged"):
            for variant, factor in A2A_VARIANTS.items():
                with jax.set_mesh(mesh), _exchange(f"a2a:{exchange}"):
                    (_, y), g = fn(x, sc, w, ad, idx, "a2a", exchange, factor)
                flat = zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True)
                c = moe_a2a.capacity(per_dev, k, e_local, peers, factor)
                out[f"{exchange}:{variant}/{name}"] = dict(
                    y_diff=float(jnp.abs(y - y_ref).max()),
                    # each gradient's worst element against that gradient's largest (sums over 256 tokens)
                    grad_diff=max(float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in flat),
                    grad_min_abs_sum=min(float(jnp.abs(b).sum()) for b in jax.tree.leaves(g_ref)),
                    rounds_needed=-(-int(sent.max()) // c),
                    # round 0's pairs past its window: only the first c tokens from each source arrive in it
                    overflow=bool(
                        (
                            np.minimum(pairs, c * min(k, e_local)).sum(axis=1)
                            > moe_a2a.pair_window(per_dev, k, e_local, peers, factor)
                        ).any()
                    ),
                )
    # bf16 tokens, scores and weights (the training dtype) through the rounds' and windows' loops, against one
    # device in bf16: each gradient's worst element against that gradient's largest
    idx = jnp.asarray(routings["all_on_device0"], jnp.int32)
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (x, sc3[:, :2], w, ad))
    (_, y_ref), g_ref = fn(*half, idx, "fsdp", "auto", 0.0)
    with jax.set_mesh(mesh):
        (_, y), g = fn(*half, idx, "a2a", "padded", A2A_VARIANTS["capacity"])

    def rel(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.abs(a - b).max() / jnp.abs(b).max())

    out["bf16/all_on_device0"] = dict(
        y_rel=rel(y, y_ref),
        grad_rel=max(rel(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True)),
        dtypes=sorted({str(a.dtype) for a in jax.tree.leaves((y, g))}),
    )
    return out


def _collective_results(hlo: str, op: str) -> list[list[tuple[int, ...]]]:
    """The result shapes of every `op` instruction of an optimized HLO module's text, one list per instruction
    (XLA:CPU splits a tiled all-to-all into one operand per peer: (f32[c, D], ...) all-to-all(...))."""
    results = re.findall(rf"= (\([^=]*?\)|\w+\[[\d,]*\]\S*) {op}\(", hlo)
    return [
        [tuple(int(v) for v in dims.split(",")) for dims in re.findall(r"\w+\[([\d,]+)\]", r)]
        for r in results
    ]


def _layer_loop_collectives(hf_dir: str) -> dict:
    """Collectives of the scanned layers' loop (the while body and what it calls) in the compiled forward with
    routing statistics, experts `fsdp` on fsdp=8: the statistics are summed per device inside the loop
    (moe.router_partials) and over devices once after it (moe.router_stats), so the loop holds the weights'
    all-gathers and no all-reduce."""
    mesh = make_mesh(fsdp=8)
    model, _ = load_model(hf_dir, mesh=mesh, scan_layers=True, param_dtype="float32", compute_dtype="float32")
    graphdef, params = nnx.split(model)
    tokens, positions, segments = _batch()

    def fwd(p):
        h, stats = nnx.merge(graphdef, p).forward_with_aux(tokens, positions, segments)
        return jnp.sum(h), stats

    with jax.set_mesh(mesh):
        hlo = jax.jit(fwd).lower(params).compile().as_text()
    inside, everywhere = collective_bytes(hlo, within_loops=True), collective_bytes(hlo)
    return dict(
        all_reduce=inside.get("all-reduce", 0),
        all_gather=inside.get("all-gather", 0),
        all_reduce_outside=everywhere.get("all-reduce", 0) - inside.get("all-reduce", 0),
    )


def _kept(hf_dir: str, lever: str) -> dict:
    """Remat `full`, scanned layers, with and without one of the levers that keep a sparse layer's transfer for
    the backward: the loss and every gradient, and the transfers in the compiled step.

    - "keep_gathered": experts `fsdp` on fsdp=8; the all-gathers of the whole experts (gate/up and down). Without
      it each is gathered in the forward and again in the backward's recompute; with it, once.
    - "keep_exchanged": experts `a2a` on data=2 x fsdp=4, one round (capacity factor 0); the all-to-alls of
      hidden-width rows. The forward's two (tokens there, outputs back) and the backward's two; without it the
      recompute sends the tokens again (no backward needs the outputs back, so that one is not re-run)."""
    out = {}
    tokens, positions, segments = _batch()
    for keep in (False, True):
        if lever == "keep_gathered":
            mesh, mode = make_mesh(fsdp=8), dict(keep_gathered_experts=keep)
        else:
            mesh = make_mesh(data=2, fsdp=4)
            mode = dict(
                expert_parallel="a2a", a2a_impl="padded", a2a_capacity_factor=0.0, keep_exchanged_tokens=keep
            )
        model, cfg = load_model(
            hf_dir, mesh=mesh, scan_layers=True, remat_policy="full", param_dtype="float32",
            compute_dtype="float32", **mode,
        )  # fmt: skip
        graphdef, params = nnx.split(model)

        def loss(p, graphdef=graphdef):
            h, stats = nnx.merge(graphdef, p).forward_with_aux(tokens, positions, segments)
            return jnp.sum(jnp.sin(h)) + 0.01 * jnp.sum(stats["lb_loss"])

        fn = jax.jit(jax.value_and_grad(loss))
        with jax.set_mesh(mesh):
            hlo = fn.lower(params).compile().as_text()
            val, grads = fn(params)
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        if (
            lever == "keep_gathered"
        ):  # one layer's whole experts ([1, E, D, 2, I] and [1, E, I, D] from the stack)
            shapes = [result[0] for result in _collective_results(hlo, "all-gather")]
            moved = (
                sum(s[-3:] == (d, 2, i) and math.prod(s) == e * d * 2 * i for s in shapes),
                sum(s[-2:] == (i, d) and math.prod(s) == e * i * d for s in shapes),
            )
        else:  # XLA:CPU splits a tiled all-to-all into one [c, D] operand per peer
            moved = sum(dims[0][-1] == d for dims in _collective_results(hlo, "all-to-all"))
        out[f"keep={keep}"] = dict(
            loss=float(val),
            grads={"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(grads)},
            moved=moved,
        )
    ref, got = out["keep=False"], out["keep=True"]
    return dict(
        loss_diff=abs(got["loss"] - ref["loss"]),
        grad_diff=max(
            float(np.abs(got["grads"][k] - g).max() / max(np.abs(g).max(), 1e-12))
            for k, g in ref["grads"].items()
        ),
        moved={k: v["moved"] for k, v in out.items()},
    )


def _a2a_exchange_rows() -> dict:
    """The rows of every all-to-all in the compiled forward and backward of mode a2a at Qwen3-30B-A3B's
    routing ratio (k = 8 of E = 32 experts over 4 devices: a token has an expert on a given device 94% of the
    time; data=2 x fsdp=4), 64 tokens per device, the default capacity factor: each token crosses once per
    device it visits, so every exchange holds P * N rows (one per (token, expert) pair would take 1.5 * N * k)."""
    rng = np.random.default_rng(5)
    p, per_dev, d, e, k, i = 4, 64, 48, 32, 8, 16
    n = 2 * p * per_dev
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    sc = jnp.asarray(rng.random((n, k)), jnp.float32)
    w = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in [(e, d, 2, i), (e, i, d)]]
    idx = jnp.asarray(np.argsort(rng.random((n, e)), -1)[:, :k], jnp.int32)

    def loss(x, sc, w):
        y = moe.experts_forward(x, moe.RouterOut(None, None, idx, sc), *w, "xla", "a2a", a2a_impl="padded")
        return jnp.sum(jnp.sin(y))

    with jax.set_mesh(make_mesh(data=2, fsdp=p)):
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, sc, w).compile().as_text()
    exchanges = [(sum(r[0] for r in dims), dims[0][-1]) for dims in _collective_results(hlo, "all-to-all")]
    return dict(
        exchanges=sorted(set(exchanges)),
        count=len(exchanges),
        tokens_per_device=per_dev,
        devices=p,
        hidden=d,
        k=k,
    )


# a2a's a2a_capacity_factor: "worst", one round of worst-case slots and every pair in round 0's window;
# "capacity", slots and window of 1.5 balanced shares, so a skewed routing takes extra rounds and overflows
# the window.
A2A_VARIANTS = {"worst": 0.0, "capacity": 1.5}


def _a2a_loss(x, sc, w, ad, idx, mode, exchange, factor):
    route_out = moe.RouterOut(None, None, idx, sc)
    y = moe.experts_forward(
        x, route_out, *w, "xla", mode, tuple(ad), 0.5, a2a_impl=exchange, a2a_capacity_factor=factor
    )
    return jnp.sum(jnp.sin(y)), y


def main(hf_dir: str, out_path: str, only: set[str] | None = None) -> None:
    """`only`: the names of the cases (of CASES and REPLAY_CASES) to run; all when None."""
    assert jax.device_count() == 8, jax.devices()
    batch = _batch()
    single, _ = load_model(hf_dir, param_dtype="float32", compute_dtype="float32")
    ref_loss, ref_logits, ref_load, ref_grads = _loss_and_grads(single, *batch)
    result = {"ref_load_total": float(ref_load.sum()), "cases": {}}
    for name, (mode, sizes) in CASES.items():
        if only is not None and name not in only:
            continue
        mesh = make_mesh(**sizes)
        model, _ = load_model(
            hf_dir, mesh=mesh, param_dtype="float32", compute_dtype="float32", **_mode(mode)
        )
        with jax.set_mesh(mesh), _exchange(mode):
            loss, logits, load, grads = _loss_and_grads(model, *batch)
        spec = model.layers.experts_gate_up[...].sharding.spec
        result["cases"][name] = dict(
            loss_diff=abs(loss - ref_loss),
            logits_diff=float(np.abs(logits - ref_logits).max()),
            load_equal=bool(np.array_equal(load, ref_load)),
            grad_diff=max(float(np.abs(grads[k] - ref_grads[k]).max()) for k in ref_grads),
            experts_spec=[list(e) if isinstance(e, tuple) else e for e in spec],
        )
        if hasattr(
            model.layers, "kv_b_proj"
        ):  # multi-head latent attention: latent over fsdp, heads over tensor
            kv_b = model.layers.kv_b_proj[...].sharding.spec
            result["cases"][name]["kv_b_spec"] = [list(e) if isinstance(e, tuple) else e for e in kv_b]
    result["replay"] = _replay(hf_dir, only)
    if only is None or "layer_loop_collectives" in only:
        result["layer_loop_collectives"] = _layer_loop_collectives(hf_dir)
    for lever in ("keep_gathered", "keep_exchanged"):
        if only is None or lever in only:
            result[lever] = _kept(hf_dir, lever)
    if only is None or "a2a_direct" in only:
        result["a2a_direct"] = _a2a_direct()
        result["a2a_exchange_rows"] = _a2a_exchange_rows()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None)
