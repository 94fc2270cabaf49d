"""LoRA through the trainer engine: the RL and SFT steps train only the adapters (the frozen weights are
bit-identical afterwards), the optimizer state holds only adapter-shaped fp32 leaves, no full-size gradient is
allocated (the compiled step's temporaries), and a checkpoint of the adapters resumes bit-identically."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from primejax.contracts.batch import pack_samples
from primejax.models import lora
from primejax.trainer.checkpoint import TrainerCheckpointer
from primejax.trainer.config import TrainerConfig
from primejax.trainer.engine import Engine

LORA = dict(lora_rank=4, lora_alpha=8.0)
MOE = dict(
    model_type="qwen3_moe", num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
)


def _host(tree):
    return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


def _shapes(tree) -> list[tuple[int, ...]]:
    return [tuple(x.shape) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def batch(make_samples):
    (b,) = pack_samples(make_samples(7, 8), 48)
    return b


def test_lora_rl_and_sft_steps_train_only_the_adapters(batch, tmp_path, make_config):
    cfg = make_config(**LORA, lora_targets=lora.DEFAULT_TARGETS)
    engine = Engine.create(TrainerConfig(micro_batch_size=2, logprob_chunk_size=16), cfg, seed=3)
    adapters = engine.state.params
    assert set(adapters["layers"]) == {
        w + s for w in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        for s in ("_lora_a", "_lora_b")
    }  # fmt: skip
    assert set(adapters) == {"layers"} and "embed" in engine.frozen and "q_proj" in engine.frozen["layers"]
    # the optimizer state: AdamW's two moments of each adapter (fp32) and scalars, nothing model-sized
    moments = [x for x in jax.tree.leaves(engine.state.opt_state) if x.ndim > 0]
    assert sorted(_shapes(moments)) == sorted(_shapes(adapters) * 2)
    assert all(x.dtype == np.float32 for x in moments + jax.tree.leaves(adapters))
    n_adapter = sum(x.size for x in jax.tree.leaves(adapters))
    n_model = sum(x.size for x in jax.tree.leaves(engine.frozen))
    assert sum(x.size for x in moments) == 2 * n_adapter and n_adapter < n_model / 4

    frozen0, adapters0 = _host(engine.frozen), _host(adapters)
    for kind in ("rl", "sft"):
        metrics, _ = engine.train(batch, kind)
        assert int(metrics["nonfinite"]) == 0 and np.isfinite(float(metrics["loss"])), kind
        assert float(metrics["grad_norm"]) > 0, kind
    after = _host(engine.state.params)
    jax.tree.map(np.testing.assert_array_equal, _host(engine.frozen), frozen0)  # base bit-identical
    for k, v in after["layers"].items():  # every adapter moved (B from zero, A through B's gradient)
        assert not np.array_equal(v, adapters0["layers"][k]), k
    assert int(engine.state.step) == 2

    # checkpoint the adapters, take a step, restore, take the same step again: bit-identical
    ckpt = TrainerCheckpointer(tmp_path, keep=2, async_save=False)
    ckpt.save(2, engine.state, {"data_step": 3})
    engine.train(batch, "rl")
    stepped = _host(engine.state)
    restored, meta = ckpt.restore(2, engine.state)
    jax.tree.map(np.testing.assert_array_equal, _host(restored.params), after)
    engine.state = restored
    engine.train(batch, "rl")
    jax.tree.map(np.testing.assert_array_equal, _host(engine.state), stepped)
    ckpt.close()


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): another engine compile
def test_lora_moe_step_trains_expert_adapters_only(batch, make_config):
    cfg = make_config(**LORA, **MOE, lora_targets=("q_proj", "experts"))
    engine = Engine.create(TrainerConfig(micro_batch_size=4, logprob_chunk_size=16), cfg, seed=1)
    assert set(engine.state.params["layers"]) == {
        "q_proj_lora_a", "q_proj_lora_b", "experts_gate_up_lora_a", "experts_gate_up_lora_b",
        "experts_down_lora_a", "experts_down_lora_b",
    }  # fmt: skip
    frozen0, adapters0 = _host(engine.frozen), _host(engine.state.params)
    metrics, _ = engine.train(batch, "rl")
    assert int(metrics["nonfinite"]) == 0
    jax.tree.map(np.testing.assert_array_equal, _host(engine.frozen), frozen0)
    after = _host(engine.state.params)["layers"]
    b = after["experts_gate_up_lora_b"]  # [Ls, E, 2, r, I]: the experts the batch reached got an update
    assert np.abs(b).reshape(b.shape[0], b.shape[1], -1).max(-1).min() > 0
    assert np.abs(after["experts_down_lora_b"]).max() > 0
    # A's gradient is zero while B is (LoRA's init): the first step moves B only
    np.testing.assert_array_equal(after["experts_down_lora_a"], adapters0["layers"]["experts_down_lora_a"])


def test_lora_step_allocates_no_full_size_gradient(make_config):
    """The compiled step's temporaries: full fine-tuning holds a gradient (and AdamW's update) of every weight,
    the LoRA step none, on a model whose MLP weights dominate everything else. Both hold the same copies of
    the weights (XLA:CPU's per-layer slices and transposes), so the difference is what is compared."""
    wide = dict(hidden_size=64, intermediate_size=4096, vocab_size=64)
    t = TrainerConfig(micro_batch_size=1, logprob_chunk_size=16)
    temp, weights = {}, 0
    for name, extra in (("full", {}), ("lora", dict(**LORA, lora_targets=lora.DEFAULT_TARGETS))):
        engine = Engine.create(t, make_config(**wide, **extra), abstract=True)
        compiled = engine.lower(engine.abstract_batch(1, 1, 32), "rl").compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
        if name == "full":
            weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.state.params))
    assert temp["full"] - temp["lora"] >= weights, (temp, weights)  # at least one model-sized gradient less


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): another engine compile
def test_lora_engine_from_hf_weights_exports_the_merged_model(tiny_untied_model_dir, tmp_path, batch):
    """`Engine.from_settings` with `model.lora`: HF weights frozen, fresh adapters; after a step the engine's
    model (what the publisher and the SFT export write) is the merged one, equal to the adapted forward."""
    import jax.numpy as jnp

    from primejax.models.hf_io import export_safetensors, load_model
    from primejax.models.settings import ModelSettings

    settings = ModelSettings(
        path=str(tiny_untied_model_dir), compute_dtype="float32", lora=lora.LoraConfig(rank=4, alpha=8.0)
    )
    engine = Engine.from_settings(TrainerConfig(micro_batch_size=8, logprob_chunk_size=16), settings, seed=2)
    assert engine.model_cfg.lora_rank == 4 and "embed" in engine.frozen
    metrics, _ = engine.train(batch, "sft")
    assert int(metrics["nonfinite"]) == 0
    export_safetensors(engine.model(), lora.without_lora(engine.model_cfg), tmp_path / "hf", dtype="float32")
    merged, _ = load_model(tmp_path / "hf", param_dtype="float32", compute_dtype="float32")
    tokens = jnp.asarray(batch.tokens[:2, :24])
    pos, seg = jnp.tile(jnp.arange(24, dtype=jnp.int32), (2, 1)), jnp.ones((2, 24), jnp.int32)
    want = jax.jit(lambda m: m.logits(tokens, pos, seg))(engine.lora_model())
    got = jax.jit(lambda m: m.logits(tokens, pos, seg))(merged)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    base, _ = load_model(tiny_untied_model_dir, param_dtype="float32", compute_dtype="float32")
    assert not np.allclose(
        np.asarray(got), np.asarray(jax.jit(lambda m: m.logits(tokens, pos, seg))(base)), atol=1e-5
    )
