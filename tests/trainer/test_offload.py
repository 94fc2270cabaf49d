"""`trainer.optim.offload`: fp32 master weights and AdamW moments in pinned host memory, streamed bucket by bucket
through the update (trainer/offload.py), against the on-device update on CPU: bit-equal parameters and moments
with one bucket, equal to 1e-6 with many (split) buckets, a bit-identical checkpoint resume, LoRA adapters, and an
FSDP-sharded MoE model on a 4-device mesh (expert modes fsdp and ep)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

from primejax.contracts.batch import pack_samples
from primejax.models import lora
from primejax.trainer.checkpoint import TrainerCheckpointer
from primejax.trainer.config import OptimConfig, TrainerConfig
from primejax.trainer.engine import Engine
from primejax.trainer.offload import HOST, assemble, make_plan


def state_trees(engine) -> dict:
    """fp32 master (or parameters), mu and nu as full host trees, whichever layout the engine keeps."""
    host = lambda t: jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), t)  # noqa: E731
    st = engine.state
    if engine.offload is None:
        get = optax.tree_utils.tree_get
        return {
            "master": host(st.params),
            "mu": host(get(st.opt_state, "mu")),
            "nu": host(get(st.opt_state, "nu")),
        }
    plan, treedef = engine.offload.plan, jax.tree.structure(st.params)
    out = {"master": assemble(plan, st.opt_state["master"], treedef)}
    for field in ("mu", "nu"):
        out[field] = assemble(
            plan, [optax.tree_utils.tree_get(o, field) for o in st.opt_state["opt"]], treedef
        )
    return out


MOE = dict(
    model_type="qwen3_moe", num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
)


def _host(tree):
    return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


def _trainer(offload: bool, bucket_mb: float = 0.01, **optim) -> TrainerConfig:
    # a tiny bucket (10 KB) so the tiny model's state spreads over many buckets and stacked leaves are split
    return TrainerConfig(
        micro_batch_size=2,
        logprob_chunk_size=16,
        optim=OptimConfig(lr=1e-2, offload=offload, offload_bucket_mb=bucket_mb, **optim),
    )


def _moments(engine: Engine) -> tuple[dict, dict]:
    """(mu, nu) as full parameter trees, whichever layout the engine keeps them in."""
    trees = state_trees(engine)
    return trees["mu"], trees["nu"]


@pytest.fixture(scope="module")
def batches(make_samples):
    return [pack_samples(make_samples(s, 8), 48)[0] for s in (1, 2, 3)]


def test_offloaded_update_with_one_bucket_is_bit_equal_to_the_device_update(batches, make_config):
    cfg = make_config()
    ref = Engine.create(_trainer(False), cfg, seed=0)
    off = Engine.create(_trainer(True, bucket_mb=1024.0), cfg, seed=0)
    assert len(off.offload.plan.buckets) == 1
    assert {x.sharding.memory_kind for x in jax.tree.leaves(off.state.opt_state)} == {HOST}
    for b in batches[:2]:
        m_ref, _ = ref.train(b)
        m_off, _ = off.train(b)
        assert int(m_off["nonfinite"]) == 0 and float(m_off["loss"]) == float(m_ref["loss"])
    jax.tree.map(np.testing.assert_array_equal, _host(off.state.params), _host(ref.state.params))
    for a, b in zip(_moments(off), _moments(ref), strict=True):
        jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): the one-bucket case is bit-equal in the default tier
def test_offloaded_update_in_split_buckets_matches_the_device_update(batches, make_config):
    # Many buckets, stacked expert weights split along their layer axis. XLA fuses the per-bucket update apart
    # from the whole-tree one and may contract a multiply-add differently (one rounding instead of two): 1-ulp
    # differences seen on decayed matrices after one step (docs/memory.md), hence a tolerance here.
    cfg = make_config(**MOE)
    ref = Engine.create(_trainer(False), cfg, seed=0)
    off = Engine.create(_trainer(True), cfg, seed=0)
    plan = off.offload.plan
    assert len(plan.buckets) > 4 and any(p.stop is not None for b in plan.buckets for p in b)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(off.state.opt_state)} == {HOST}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(off.state.params)} == {"device"}
    for b in batches:
        m_ref, _ = ref.train(b)
        m_off, _ = off.train(b)
        assert int(m_off["nonfinite"]) == 0
        np.testing.assert_allclose(float(m_off["loss"]), float(m_ref["loss"]), rtol=1e-6)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # noqa: E731
    jax.tree.map(close, _host(off.state.params), _host(ref.state.params))
    assert int(off.state.step) == int(ref.state.step) == 3
    assert {x.sharding.memory_kind for x in jax.tree.leaves(off.state.opt_state)} == {HOST}


def test_master_and_resident_buckets_on_the_devices_match_the_device_update(batches, make_config, tmp_path):
    """`offload_master` False keeps every fp32 master on the devices; `offload_resident_gib` keeps the first
    buckets' moments there too; the other moments stay in host memory. With two buckets in flight, over both kinds of bucket,
    the parameters and moments match the on-device update, and a checkpoint of the mixed layout resumes
    bit-identically, into the same placement or the default one."""
    cfg = make_config()
    ref = Engine.create(_trainer(False), cfg, seed=0)
    plan = Engine.create(_trainer(True), cfg, seed=0).offload.plan
    layout = lambda k: tuple((p.leaf, plan.piece_shape(p)) for p in plan.buckets[k])  # noqa: E731
    # the boundary between two buckets of one layout (slices of a stacked parameter), which share a builder
    r = next(k for k in range(1, len(plan.buckets)) if layout(k) == layout(k - 1))
    first = sum(plan.bucket_bytes(k) for k in range(r)) * 2  # the 2 fp32 moments that would be on the host
    off = Engine.create(
        _trainer(True, offload_master=False, offload_inflight=2, offload_resident_gib=first / 2**30),
        cfg,
        seed=0,
    )
    n = len(off.offload.plan.buckets)
    assert n > r + 2 and off.offload.resident == (True,) * r + (False,) * (n - r)

    def kinds():
        st = off.state.opt_state
        return [
            (
                {x.sharding.memory_kind for x in jax.tree.leaves(st["master"][k])},
                {x.sharding.memory_kind for x in jax.tree.leaves(st["opt"][k])},
            )
            for k in range(n)
        ]

    want = [({"device"}, {"device"})] * r + [({"device"}, {HOST})] * (n - r)
    assert kinds() == want
    for b in batches[:2]:
        ref.train(b)
        off.train(b)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # noqa: E731 (split buckets: 1 ulp)
    jax.tree.map(close, _host(off.state.params), _host(ref.state.params))
    for a, b in zip(_moments(off), _moments(ref), strict=True):
        jax.tree.map(close, a, b)
    assert kinds() == want
    ckpt = TrainerCheckpointer(tmp_path, keep=2, async_save=False)
    ckpt.save(2, off.state, {"data_step": 2})
    off.train(batches[2])
    stepped = _host(off.state)
    off.state, _ = ckpt.restore(2, off.state)
    assert kinds() == want
    off.train(batches[2])
    jax.tree.map(np.testing.assert_array_equal, _host(off.state), stepped)
    # the placement is not part of the checkpoint: it resumes into the default one (all in host memory) as well
    other = Engine.create(_trainer(True), cfg, seed=0)
    other.state, _ = ckpt.restore(2, other.state)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(other.state.opt_state)} == {HOST}
    other.train(batches[2])
    jax.tree.map(np.testing.assert_array_equal, _host(other.state), stepped)
    ckpt.close()


def test_offloaded_checkpoint_resumes_bit_identically(batches, make_config, tmp_path):
    engine = Engine.create(_trainer(True), make_config(), seed=0)
    engine.train(batches[0])
    ckpt = TrainerCheckpointer(tmp_path, keep=2, async_save=False)
    ckpt.save(1, engine.state, {"data_step": 1})
    engine.train(batches[1])
    stepped = _host(engine.state)
    restored, _ = ckpt.restore(1, engine.state)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(restored.opt_state)} == {HOST}
    engine.state = restored
    engine.train(batches[1])
    jax.tree.map(np.testing.assert_array_equal, _host(engine.state), stepped)
    ckpt.close()


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): another compiled step
def test_bf16_compute_copy_keeps_the_fp32_master(batches, make_config):
    engine = Engine.create(_trainer(True), make_config(param_dtype="bfloat16"), seed=0)
    for b in batches:
        engine.train(b)
    params = _host(engine.state.params)
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("bfloat16")}
    moved_below_bf16 = 0
    master = state_trees(engine)["master"]  # the buckets' slices joined into whole parameters
    for leaf, m in zip(jax.tree.leaves(params), jax.tree.leaves(master), strict=True):
        assert m.dtype == np.float32
        np.testing.assert_array_equal(leaf, m.astype(leaf.dtype))  # the compute copy is the rounded master
        moved_below_bf16 += int((m != m.astype(leaf.dtype).astype(np.float32)).sum())
    assert moved_below_bf16 > 0  # the master holds what bf16 cannot


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): another compiled step
def test_lora_adapters_offloaded_match_the_device_update(batches, make_config):
    cfg = make_config(lora_rank=4, lora_alpha=8.0, lora_targets=lora.DEFAULT_TARGETS)
    ref = Engine.create(_trainer(False), cfg, seed=3)
    off = Engine.create(_trainer(True), cfg, seed=3)
    frozen0 = _host(off.frozen)
    for b in batches[:2]:
        ref.train(b)
        off.train(b)
    jax.tree.map(np.testing.assert_array_equal, _host(off.state.params), _host(ref.state.params))
    jax.tree.map(np.testing.assert_array_equal, _host(off.frozen), frozen0)


def test_plan_splits_only_unsharded_leading_axes():
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1,), ("fsdp",))
    sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))  # noqa: E731
    params = {
        "a": sds((8, 256), PartitionSpec()),
        "b": sds((8, 256), PartitionSpec("fsdp")),
        "c": sds((4,), PartitionSpec()),
    }
    plan = make_plan(params, bucket_bytes=2 * 256 * 4)  # two rows of a/b per bucket
    a_pieces = [p for b in plan.buckets for p in b if p.leaf == 0]
    assert [(p.start, p.stop) for p in a_pieces] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [p.stop for b in plan.buckets for p in b if p.leaf == 1] == [None]  # sharded axis 0: whole
    assert all(len({p.leaf for p in b}) == len(b) for b in plan.buckets)


def test_init_compiles_one_builder_per_bucket_layout():
    # a 48-layer MoE's state spans tens of buckets but a handful of layouts; one compile per bucket cost minutes
    import jax.numpy as jnp
    import optax
    from jax.monitoring import register_event_duration_secs_listener
    from jax.sharding import NamedSharding, PartitionSpec

    from primejax.trainer.offload import make_offload

    mesh = jax.make_mesh((1,), ("fsdp",))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec()))  # noqa: E731
    params = {"layers": put(jnp.arange(16 * 96, dtype=jnp.float32).reshape(16, 96)), "norm": put(jnp.ones(8))}
    off = make_offload(params, None, optax.adamw(1e-3), mesh, bucket_mb=2 * 96 * 4 / 2**20)
    assert len(off.plan.buckets) == 9  # 8 slices of two layers, then the norm
    compiles = []
    register_event_duration_secs_listener(
        lambda event, _secs, **_: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    state = off.init(params)
    builders = len(compiles)
    # the two builders and a small helper program or two (one compile per bucket: 10)
    assert builders <= 4, f"{builders} compiles for 9 buckets of 2 layouts"
    got = np.concatenate([np.asarray(m["layers"]) for m in state["master"][:8]])
    np.testing.assert_array_equal(got, np.asarray(params["layers"]))


_MESH_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax, numpy as np
    from conftest import random_samples, tiny_config
    from primejax.contracts.batch import pack_samples
    from primejax.trainer.config import MeshConfig, OptimConfig, TrainerConfig
    from primejax.trainer.engine import Engine

    assert jax.device_count() == 4
    batches = [pack_samples(random_samples(s, 12, max_len=24), 32, pad_rows_to_multiple=8)[0] for s in (1, 2)]
    for ep in ("fsdp", "ep"):
        cfg = tiny_config(model_type="qwen3_moe", num_layers=2, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=16, expert_parallel=ep, scan_layers=True)
        params = {}
        for offload in (False, True):
            t = TrainerConfig(mesh=MeshConfig(data=2, fsdp=2), micro_batch_size=2, logprob_chunk_size=16,
                              optim=OptimConfig(lr=1e-2, offload=offload, offload_bucket_mb=0.01))
            engine = Engine.create(t, cfg, seed=0)
            for b in batches:
                m, _ = engine.train(b)
                assert int(m["nonfinite"]) == 0
            if offload:
                kinds = {x.sharding.memory_kind for x in jax.tree.leaves(engine.state.opt_state)}
                assert kinds == {"pinned_host"}, kinds
                assert any(len(x.sharding.device_set) == 4 and not x.sharding.is_fully_replicated
                           for x in jax.tree.leaves(engine.state.opt_state))  # the host state is sharded too
            params[offload] = jax.tree.map(np.asarray, engine.state.params)
        for a, b in zip(jax.tree.leaves(params[True]), jax.tree.leaves(params[False]), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    print("ok")
    """
)


@pytest.mark.slow
def test_offload_on_a_4_device_mesh_with_both_expert_modes_matches_the_device_update():
    here = os.path.dirname(os.path.abspath(__file__))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
    }
    out = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT, here], capture_output=True, text=True, timeout=1200, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")
