"""The trainer process end to end on CPU: rollout files in, broadcasts and checkpoints out, exact resume."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from primejax.config import default_config, typed
from primejax.contracts.batch import pack_samples, step_dir, write_batch
from primejax.entrypoints.trainer import train
from primejax.models.hf_io import load_model
from primejax.models.tiny import build_tiny_model
from primejax.trainer.checkpoint import complete_steps
from primejax.trainer.loop import NonFiniteError, Trainer
from primejax.transports.weights.filesystem.broadcast import broadcast_dir, stable_steps, verify_broadcast
from primejax.utils.monitor import read_jsonl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model",
        tied=False,
        hidden_size=32,
        head_dim=32,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        seed=3,
    )


def write_rollouts(run, steps, vocab, make_samples):
    for step in steps:
        samples = make_samples(100 + step, 6, max_len=20)
        for s in samples:
            s.token_ids = [t % vocab for t in s.token_ids]
        (b,) = pack_samples(samples, seq_len=32, pad_rows_to_multiple=4)
        b = b.pad_rows(4)
        write_batch(step_dir(run, step), 0, b, meta={"step": step})


def make_cfg(root, model_dir, name, max_steps, **trainer):
    c = default_config()
    c.run.output_dir, c.run.name, c.run.max_steps = str(root), name, max_steps
    c.model.path = str(model_dir)
    c.model.compute_dtype = "float32"
    c.orchestrator.async_level = 1
    t = c.trainer
    t.optim.lr = 1e-2
    t.micro_batch_size = 2
    t.logprob_chunk_size = 16
    t.batch_timeout_s = 5.0
    t.broadcast.dtype = "float32"
    for k, v in trainer.items():
        node = t
        *parents, leaf = k.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = v
    c.monitor.tensorboard = False
    return typed(c)


def trainer_of(cfg) -> Trainer:
    return Trainer(cfg.trainer, cfg.model, cfg.run, async_level=cfg.orchestrator.async_level)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, model_dir, make_samples):
    """6 steps from rollout files, checkpoint every 3: the reference for resume and export checks."""
    root = tmp_path_factory.mktemp("runs")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    write_rollouts(root / "a", range(1, 7), vocab, make_samples)
    write_rollouts(root / "b", range(1, 7), vocab, make_samples)
    cfg = make_cfg(
        root, model_dir, "a", 6, **{"checkpoint.interval": 3, "checkpoint.keep": 1, "keep_rollouts": 1}
    )
    state = train(cfg)
    return root, cfg, state


def test_loop_writes_metrics_broadcasts_and_checkpoints(straight_run):
    root, cfg, _ = straight_run
    run = root / "a"
    rows = read_jsonl(run / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert r["nonfinite"] == 0 and r["tokens/rl"] > 0 and r["perf/tokens"] == 4 * 32
        assert r["export/seconds"] > 0 and r["export/gb_per_s"] > 0
    # async_level 1: after step 6 only steps 5 and 6 are kept
    assert stable_steps(run) == [5, 6]
    verify_broadcast(broadcast_dir(run, 6))
    assert complete_steps(run) == [6]  # keep=1 pruned step 3
    # keep_rollouts 1: consumed batches up to the newest checkpoint (6) except the newest one are gone
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["step_6"]


def test_consumed_rollouts_after_the_newest_checkpoint_stay(tmp_path, model_dir, make_samples):
    """A trainer resumed on its own reads the batches after its newest checkpoint again: those are kept,
    whatever keep_rollouts says; without checkpoints only keep_rollouts counts; -1 keeps everything."""
    from primejax.trainer.checkpoint import META

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    run = tmp_path / "e"
    write_rollouts(run, range(1, 7), vocab, make_samples)
    (run / "rollouts" / ".step_7.x.tmp").mkdir()  # an unfinished write is never touched
    left = lambda: sorted(p.name for p in (run / "rollouts").iterdir())  # noqa: E731

    trainer_of(make_cfg(tmp_path, model_dir, "e", 6, keep_rollouts=-1)).prune_consumed(5)
    assert len(left()) == 7
    trainer = trainer_of(make_cfg(tmp_path, model_dir, "e", 6, keep_rollouts=0, **{"checkpoint.interval": 2}))
    (run / "checkpoints" / "step_2" / "trainer").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "trainer" / META).write_text("{}")  # newest finished checkpoint: 2
    trainer.prune_consumed(5)
    assert left() == [".step_7.x.tmp", "step_3", "step_4", "step_5", "step_6"]
    # checkpoints off (they are on by default): keep_rollouts alone counts
    trainer_of(
        make_cfg(tmp_path, model_dir, "e", 6, keep_rollouts=2, **{"checkpoint.interval": 0})
    ).prune_consumed(5)
    assert left() == [".step_7.x.tmp", "step_4", "step_5", "step_6"]


def test_broadcast_loads_in_transformers_with_the_trainers_logits(straight_run, model_dir):
    root, cfg, state = straight_run
    abstract, model_cfg = load_model(model_dir, compute_dtype="float32")
    graphdef = nnx.graphdef(abstract)
    ours = nnx.merge(graphdef, state.params)
    tokens = np.array([[3, 17, 42, 5, 9, 11, 2, 8]], np.int32)
    pos = np.arange(8, dtype=np.int32)[None]
    seg = np.ones_like(tokens)
    our_logits = np.asarray(ours.logits(tokens, pos, seg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(broadcast_dir(root / "a", 6), dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(our_logits, hf_logits, atol=2e-4, rtol=1e-4)
    # and training really moved the weights away from the initial model
    initial = np.asarray(load_model(model_dir, compute_dtype="float32")[0].logits(tokens, pos, seg))
    assert np.abs(initial - our_logits).max() > 1e-2


def test_resume_is_bit_identical(straight_run, model_dir):
    root, _, state_a = straight_run
    first = make_cfg(root, model_dir, "b", 3, **{"checkpoint.interval": 3})
    train(first)
    assert complete_steps(root / "b") == [3]
    resumed = make_cfg(root, model_dir, "b", 6, **{"checkpoint.interval": 3})
    resumed = resumed.replace(run=resumed.run.replace(resume_step="latest"))
    state_b = train(resumed)
    assert int(state_b.step) == int(state_a.step) == 6
    for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    steps = [r["step"] for r in read_jsonl(root / "b" / "metrics" / "trainer.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_missing_rollouts_time_out_with_the_path(tmp_path, model_dir):
    cfg = make_cfg(tmp_path, model_dir, "c", 1, batch_timeout_s=0.0)
    with pytest.raises(TimeoutError, match="rollouts/step_1/rank_0.npz"):
        train(cfg)


def test_nonfinite_stop_raises(tmp_path, model_dir, make_samples):
    """A huge (finite: the config refuses inf) learning rate makes step 1's weights ~1e38, so step 2's gradient
    is NaN: "stop" raises there. (An update that is itself non-finite: tests/hardening.)"""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    write_rollouts(tmp_path / "d", (1, 2), vocab, make_samples)
    cfg = make_cfg(tmp_path, model_dir, "d", 2, on_nonfinite="stop", **{"optim.lr": 1e38})
    with pytest.raises(NonFiniteError, match="step 2: non-finite loss, gradient or update"):
        trainer_of(cfg).run()
