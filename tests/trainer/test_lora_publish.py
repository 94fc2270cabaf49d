"""LoRA broadcasts: the trainer publishes each step's adapter alone as a PEFT directory with its STABLE manifest
(what the inference server loads by version name), prunes like full broadcasts, and keeps the filesystem when
the collective mode is asked for (it does not carry adapters)."""

from __future__ import annotations

import logging

import jax
import numpy as np

from primejax.contracts.broadcast import stable_steps, verify_broadcast
from primejax.contracts.rundir import RunDir
from primejax.inference.adapters import check_adapter_dir
from primejax.models import lora
from primejax.models.lora_io import read_peft
from primejax.trainer.config import BroadcastConfig, TrainerConfig
from primejax.trainer.engine import Engine
from primejax.trainer.publish import AdapterPublisher, FilesystemPublisher, make_publisher


def _publisher(b, root, cfg):
    return make_publisher(b, root, cfg, async_level=1, max_steps=10, checkpoint_interval=0)


def test_adapter_broadcast_is_a_peft_dir_the_server_accepts_and_reads_back_exactly(tmp_path, make_config):
    cfg = make_config(lora_rank=4, lora_alpha=8.0, lora_targets=lora.DEFAULT_TARGETS)
    engine = Engine.create(TrainerConfig(micro_batch_size=2), cfg, seed=3)
    rng = np.random.default_rng(0)  # B starts at zero: give every adapter a value to tell them apart
    engine.state = engine.state.replace(
        params=jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), engine.state.params)
    )
    pub = _publisher(BroadcastConfig(), tmp_path, cfg)
    assert isinstance(pub, AdapterPublisher)
    for step in (1, 2, 3):
        metrics = pub.publish(step, engine.lora_model())
    assert stable_steps(tmp_path) == [2, 3]  # async_level 1: step 1 can no longer be asked for
    d = RunDir(tmp_path).broadcasts(3)
    verify_broadcast(d)
    assert check_adapter_dir(d, max_rank=8)["r"] == 4
    back = read_peft(d, cfg)
    for k, v in engine.state.params["layers"].items():
        np.testing.assert_array_equal(back["layers"][k], np.asarray(v), err_msg=k)
    n_adapter = sum(x.size for x in jax.tree.leaves(engine.state.params))
    assert (
        4 * n_adapter <= metrics["export/gb"] * 1e9 < 4 * n_adapter + 20_000
    )  # fp32 adapters + config/header


def test_collective_mode_with_lora_falls_back_to_the_filesystem_in_one_line(tmp_path, make_config, caplog):
    cfg = make_config(lora_rank=4, lora_alpha=8.0, lora_targets=("q_proj",))
    with caplog.at_level(logging.WARNING, logger="primejax.trainer"):
        pub = _publisher(BroadcastConfig(mode="collective"), tmp_path, cfg)
    assert isinstance(pub, AdapterPublisher)
    assert [r.message for r in caplog.records if "does not carry LoRA adapters" in r.message]
    merged = _publisher(BroadcastConfig(lora="merged"), tmp_path, cfg)  # merged full weights, as before
    assert isinstance(merged, FilesystemPublisher)
