"""LoRA adapters over the collective protocol, server side (transports/weights/adapters/receiver.py): a trainer-side
`CollectiveSender` (one or two lanes, gloo) -> `/transfer_weights` over the recording fake engine of
test_adapters.py: the adapter arrives bit-exact in a private PEFT directory, is loaded as `policy-v<N>` without a
pause, and its directory goes when the adapter is unloaded; a bad round is refused with one line and loads nothing."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from primejax.transports.weights.adapters.dirs import check_adapter_dir
from primejax.transports.weights.adapters.receiver import ADAPTER_KEY, PrivateAdapterDirs
from primejax.transports.weights.collective.lanes import Piece, rows
from primejax.transports.weights.collective.offer import latest_offer
from primejax.transports.weights.collective.sender import CollectiveSender, tensor_metas
from tests.inference.test_adapters import FakeLoraEngine, _app

SECRET = "adapter-transfer-test-secret"
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture
def base_dir(tiny_model_dir):
    return tiny_model_dir  # the session's tiny model: the route's validator reads its config only


def _adapter(seed: int, rank: int = 4) -> list[tuple[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(2):
        for m, width in (("q_proj", 64), ("v_proj", 32)):
            key = f"base_model.model.model.layers.{i}.self_attn.{m}"
            out.append((f"{key}.lora_A.weight", rng.normal(size=(rank, 64)).astype(np.float32)))
            out.append((f"{key}.lora_B.weight", rng.normal(size=(width, rank)).astype(np.float32)))
    return [(n, torch.from_numpy(a)) for n, a in out]


def _server(base_dir, tmp_path, max_lora_rank=8):
    engine = FakeLoraEngine()
    client, state = _app(base_dir, engine, max_lora_rank=max_lora_rank)
    state.admin_token = (
        SECRET  # the run's secret: the receiver authenticates the trainer's rendezvous with it
    )
    state.private_adapters = PrivateAdapterDirs(str(tmp_path / "private"))
    (tmp_path / "private").mkdir()
    return client, state, engine


def _orchestrate(run_dir, client, steps, answers):
    """The orchestrator's part: each step's offer -> POST /transfer_weights as server 0 (rank 1)."""
    for step in steps:
        deadline = time.monotonic() + 20
        while (offer := latest_offer(run_dir)) is None or offer.step != step:
            assert time.monotonic() < deadline, f"no offer of step {step}"
            time.sleep(0.01)
        body = {
            "version": step,
            "init_info": {**offer.init_info, "rank_offset": 1},
            "update_info": offer.update_info,
        }
        answers.append(client.post("/transfer_weights", json=body))


def test_collective_adapter_rounds_load_by_version_name_from_private_dirs(base_dir, tmp_path):
    client, state, engine = _server(base_dir, tmp_path)
    sender = CollectiveSender(tmp_path, secret=SECRET, timeout_s=10, bucket_bytes=1024)
    adapters = {step: _adapter(step) for step in (1, 2, 3)}
    answers: list = []
    t = threading.Thread(target=_orchestrate, args=(tmp_path, client, (1, 2, 3), answers))
    t.start()
    assert all(sender.send(step, adapters[step], extra={ADAPTER_KEY: CONFIG}) for step in (1, 2, 3))
    t.join(30)
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert answers[-1].json()["adapter"] == "policy-v3" and answers[-1].json()["transport"] == "collective"
    loads = [c for c in engine.calls if c[0] == "load_adapter"]
    assert [c[1] for c in loads] == ["policy-v1", "policy-v2", "policy-v3"]
    assert not [c for c in engine.calls if c[0] in ("pause", "load", "reset")]  # nothing paused or reloaded
    for (_, _, directory), step in zip(loads[1:], (2, 3), strict=True):
        d = Path(directory)
        assert d.parent == tmp_path / "private" and (d.stat().st_mode & 0o777) == 0o700
        assert check_adapter_dir(d, max_rank=8) == CONFIG  # the filesystem route's check accepts it
        got = load_file(str(d / "adapter_model.safetensors"))
        assert list(got) == sorted(n for n, _ in adapters[step])
        for n, t_ in adapters[step]:
            np.testing.assert_array_equal(got[n], t_.numpy(), err_msg=n)  # bit-exact
    # policy-v1 was retired (two newer ones served) and unloaded: its private copy is gone with it.
    assert ("unload_adapter", "policy-v1") in engine.calls
    assert not Path(loads[0][2]).exists()
    assert sorted(state.private_adapters.dirs) == ["policy-v2", "policy-v3"]
    assert sender.group is not None  # the group is reused round after round


def test_adapter_round_from_two_senders_arrives_whole(base_dir, tmp_path):
    """A multi-process trainer splits the adapter's tensors between its lanes (transports/weights/publish.py)."""
    client, state, engine = _server(base_dir, tmp_path)
    named = _adapter(7)
    metas = tensor_metas(named)
    pieces = [Piece(i, i % 2, 0, rows(m)) for i, m in enumerate(metas)]
    lane0 = CollectiveSender(tmp_path, secret=SECRET, timeout_s=10, bucket_bytes=512, senders=2)
    lane1 = CollectiveSender(
        tmp_path, secret=SECRET, timeout_s=10, bucket_bytes=512, port=lane0.port, lane=1, senders=2
    )
    ok = []

    def send(sender, lane):
        mine = (t for i, (_, t) in enumerate(named) if i % 2 == lane)
        ok.append(
            sender.send_lazy(1, metas, mine, pieces=pieces, ids=("g1", "1-r1"), extra={ADAPTER_KEY: CONFIG})
        )

    threads = [threading.Thread(target=send, args=(s, k)) for k, s in enumerate((lane0, lane1))]
    for th in threads:
        th.start()
    answers: list = []
    _orchestrate(tmp_path, client, (1,), answers)
    for th in threads:
        th.join(30)
    assert answers[0].status_code == 200, answers[0].text
    assert ok == [True, True]
    got = load_file(str(Path(state.private_adapters.dirs["policy-v1"]) / "adapter_model.safetensors"))
    for n, t_ in named:
        np.testing.assert_array_equal(got[n], t_.numpy(), err_msg=n)


def _round(named, config, **init):
    metas = tensor_metas(named)
    info = {
        "round_id": "1-x",
        "wire_version": 2,
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [list(m.shape) for m in metas],
        ADAPTER_KEY: config,
    }
    init_info = {"master_address": "127.0.0.1", "master_port": 1, "group_id": "g", "world_size": 2}
    return {
        "version": 3,
        "init_info": {**init_info, "timeout_s": 1, "rank_offset": 1, **init},
        "update_info": info,
    }


@pytest.mark.parametrize(
    "max_rank, named, config, init, fragment",
    [
        (0, _adapter(1), CONFIG, {}, "started without LoRA"),
        (2, _adapter(1), CONFIG, {}, "rank 4 is not in 1..2"),
        (8, _adapter(1), {**CONFIG, "peft_type": "IA3"}, {}, "not a PEFT LoRA config"),
        (
            8,
            [*_adapter(1), ("model.layers.0.mlp.up_proj.weight", torch.zeros(4, 4))],
            CONFIG,
            {},
            "other than lora_A",
        ),
        (8, [(n, t.to(torch.bfloat16)) for n, t in _adapter(1)], CONFIG, {}, "is not an fp32"),
        (8, _adapter(1, rank=2), CONFIG, {}, "of rank 4"),
        (8, _adapter(1), CONFIG, {"backend": "nccl"}, "travel over gloo"),
    ],
)
def test_bad_adapter_round_is_refused_with_one_line_and_nothing_loaded(
    base_dir, tmp_path, max_rank, named, config, init, fragment
):
    client, state, engine = _server(base_dir, tmp_path, max_lora_rank=max_rank)
    r = client.post("/transfer_weights", json=_round(named, config, **init))
    assert r.status_code == 422 and fragment in r.json()["error"] and "\n" not in r.json()["error"], r.text
    assert "still serving version 0" in r.json()["error"]
    assert engine.calls == [] and state.version == 0 and not list((tmp_path / "private").iterdir())


def test_adapter_round_whose_trainer_is_gone_loads_nothing(base_dir, tmp_path):
    """Nobody listens at the offer's rendezvous: 502 after the transfer timeout, nothing loaded, no dir left."""
    client, state, engine = _server(base_dir, tmp_path)
    r = client.post("/transfer_weights", json=_round(_adapter(1), CONFIG))
    assert r.status_code == 502 and "nothing loaded, still serving version 0" in r.json()["error"], r.text
    assert engine.calls == [] and state.version == 0 and not list((tmp_path / "private").iterdir())
    assert json.loads(json.dumps(state.describe()))["adapter"] == ""


class FailingLoadEngine(FakeLoraEngine):
    async def load_adapter(self, name, adapter_dir):
        await super().load_adapter(name, adapter_dir)
        raise RuntimeError("vLLM refused the adapter")


def test_adapter_that_fails_to_load_is_not_acknowledged(base_dir, tmp_path):
    """The adapter is loaded before the round is acknowledged: a load that fails leaves the trainer without an
    acknowledgement (it falls back to the filesystem), the route answers 502 and serves nothing new."""
    client, state, _ = _server(base_dir, tmp_path)
    state.engine = engine = FailingLoadEngine()
    sender = CollectiveSender(tmp_path, secret=SECRET, timeout_s=2, bucket_bytes=1024)
    answers: list = []
    t = threading.Thread(target=_orchestrate, args=(tmp_path, client, (1,), answers))
    t.start()
    assert sender.send(1, _adapter(1), extra={ADAPTER_KEY: CONFIG}) is False
    t.join(30)
    assert answers[0].status_code == 502 and "vLLM refused the adapter" in answers[0].json()["error"]
    assert [c[0] for c in engine.calls] == ["load_adapter"]  # tried once, nothing to unload
    assert state.version == 0 and state.adapters.current == "" and not list((tmp_path / "private").iterdir())
