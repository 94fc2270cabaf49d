"""LoRA broadcasts: the trainer publishes each step's adapter alone as a PEFT directory with its STABLE manifest
(what the inference server loads by version name), prunes like full broadcasts; in the collective mode the
adapter alone travels over the collective protocol to the server (the filesystem as its fallback)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from primejax.contracts.rundir import RunDir
from primejax.models import lora
from primejax.models.lora_io import read_peft
from primejax.trainer.config import BroadcastConfig, TrainerConfig
from primejax.trainer.engine import Engine
from primejax.transports.weights.adapters.dirs import check_adapter_dir
from primejax.transports.weights.collective.publisher import CollectivePublisher
from primejax.transports.weights.filesystem.broadcast import stable_steps, verify_broadcast
from primejax.transports.weights.publish import AdapterPublisher, FilesystemPublisher, make_publisher


@pytest.fixture(scope="module")
def lora_engine(make_config):
    """A LoRA engine (rank 4) whose adapters all hold distinct values (B starts at zero); built once per module:
    the first JAX compilations of a model cost ~30 s on the 2-core box."""
    cfg = make_config(lora_rank=4, lora_alpha=8.0, lora_targets=lora.DEFAULT_TARGETS)
    engine = Engine.create(TrainerConfig(micro_batch_size=2), cfg, seed=3)
    rng = np.random.default_rng(0)
    engine.state = engine.state.replace(
        params=jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), engine.state.params)
    )
    return cfg, engine


def _publisher(b, root, cfg):
    return make_publisher(b, root, cfg, async_level=1, max_steps=10, checkpoint_interval=0)


def test_adapter_broadcast_is_a_peft_dir_the_server_accepts_and_reads_back_exactly(tmp_path, lora_engine):
    cfg, engine = lora_engine
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


def test_collective_mode_with_lora_sends_the_adapter_alone_to_the_server(
    tmp_path, lora_engine, tiny_model_dir
):
    """trainer.broadcast.mode=collective with LoRA: the step's adapter goes over the collective protocol to the
    server's /transfer_weights (the recording fake engine of tests/inference/test_adapters.py), which serves it as
    policy-v1 from a PEFT directory holding exactly what the filesystem broadcast writes; nothing is written to
    broadcasts/ (not a checkpoint step)."""
    from primejax.inference.admin_auth import write_run_token
    from primejax.transports.weights.collective.offer import latest_offer
    from tests.inference.test_adapters import FakeLoraEngine, _app

    cfg, engine = lora_engine
    run = tmp_path / "run"
    run.mkdir()
    token = write_run_token(run)
    pub = _publisher(BroadcastConfig(mode="collective", transfer_timeout_s=20), run, cfg)
    assert isinstance(pub, CollectivePublisher) and pub.adapters and pub.num_receivers == 1
    fake = FakeLoraEngine()
    client, state = _app(tiny_model_dir, fake)
    state.admin_token = token
    answers: list = []
    infos: list = []

    def orchestrate():
        deadline = time.monotonic() + 30
        while (offer := latest_offer(run)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        init = {
            **offer.init_info,
            "rank_offset": 1,
        }  # what InferenceClient.transfer_weights adds for server 0
        answers.append(
            client.post(
                "/transfer_weights", json={"version": 1, "init_info": init, "update_info": offer.update_info}
            )
        )
        infos.append(offer.update_info)

    t = threading.Thread(target=orchestrate)
    t.start()
    metrics = pub.publish(1, engine.lora_model())
    t.join(30)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert "transfer/failed" not in metrics and metrics["transfer/gb"] > 0
    # Equal-shaped tensors sent next to each other, so each shape travels as one stack (issue 47).
    shapes = Counter(tuple(x) for x in infos[0]["shapes"])
    assert len(infos[0]["stacks"]) == sum(c > 1 for c in shapes.values()) > 0
    assert stable_steps(run) == []  # the adapter travelled alone: no broadcast written
    assert [c[:2] for c in fake.calls] == [("load_adapter", "policy-v1")]
    served = fake.calls[0][2]
    disk = AdapterPublisher(tmp_path / "disk", cfg, BroadcastConfig(), async_level=1)
    disk.publish(1, engine.lora_model())
    on_disk = RunDir(tmp_path / "disk").broadcasts(1)
    assert json.loads((Path(served) / "adapter_config.json").read_text()) == json.loads(
        (on_disk / "adapter_config.json").read_text()
    )
    got, want = (load_file(str(Path(d) / "adapter_model.safetensors")) for d in (served, on_disk))
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)  # bit-identical to the filesystem's
    back = read_peft(served, cfg)
    for k, v in engine.state.params["layers"].items():
        np.testing.assert_array_equal(back["layers"][k], np.asarray(v), err_msg=k)


def test_collective_adapter_without_a_server_falls_back_to_the_filesystem(tmp_path, lora_engine):
    from primejax.inference.admin_auth import write_run_token

    cfg, engine = lora_engine
    write_run_token(tmp_path)
    pub = _publisher(BroadcastConfig(mode="collective", transfer_timeout_s=1), tmp_path, cfg)
    metrics = pub.publish(1, engine.lora_model())
    assert metrics["transfer/failed"] == 1.0 and metrics["export/gb"] > 0
    d = RunDir(tmp_path).broadcasts(1)
    verify_broadcast(d)
    assert check_adapter_dir(d, max_rank=8)["r"] == 4


def test_merged_lora_keeps_full_weights(tmp_path, make_config):
    cfg = make_config(lora_rank=4, lora_alpha=8.0, lora_targets=("q_proj",))
    merged = _publisher(BroadcastConfig(lora="merged"), tmp_path, cfg)  # merged full weights, as before
    assert isinstance(merged, FilesystemPublisher)
