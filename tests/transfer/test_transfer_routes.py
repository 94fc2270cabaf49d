"""/transfer_weights against a recording fake engine: protocol order, validation, restore or unhealthy."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from primejax.inference.routes import AdminState, router
from primejax.models.tiny import build_tiny_model
from primejax.transports.weights.validate import WeightDirValidator, read_checkpoint_tensors
from tests.inference.recording_engine import RecordingEngine


class FakeEngine(RecordingEngine):
    def __init__(self):
        super().__init__()
        self.fail_transfer = False

    async def transfer_weights(self, init_info, update_info):
        self.calls.append(("transfer", update_info["round_id"]))
        if self.fail_transfer:
            raise RuntimeError("gloo: connection closed by peer")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("xfer-routes") / "base")


def _client(base_dir, engine, enabled=True):
    app = FastAPI()
    app.include_router(router)
    v = WeightDirValidator(base_dir)
    app.state.primejax = AdminState(
        engine=engine,
        base_dir=str(base_dir),
        validate=v,
        check_transfer=v.check_update_info if enabled else None,
    )
    return TestClient(app), app.state.primejax


def _body(base_dir, version=3, round_id="r1", **update):
    tensors = read_checkpoint_tensors(base_dir)
    info = {
        "round_id": round_id,
        "wire_version": 2,
        "names": list(tensors),
        "dtype_names": ["bfloat16"] * len(tensors),
        "shapes": [list(t.shape) for t in tensors.values()],
        **update,
    }
    init = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "group_id": "g",
        "rank_offset": 1,
        "world_size": 2,
        "timeout_s": 5,
    }
    return {"version": version, "init_info": init, "update_info": info}


def test_transfer_runs_the_update_protocol_and_publishes_the_version(base_dir):
    engine = FakeEngine()
    client, state = _client(base_dir, engine)
    r = client.post("/transfer_weights", json=_body(base_dir))
    assert r.status_code == 200, r.text
    assert engine.calls == [("pause",), ("transfer", "r1"), ("reset",), ("resume",)]
    assert r.json()["version"] == 3 and r.json()["transport"] == "collective" and state.weight_dir == ""


def test_transfer_is_refused_when_disabled_or_malformed(base_dir):
    engine = FakeEngine()
    client, _ = _client(base_dir, engine, enabled=False)
    assert client.post("/transfer_weights", json=_body(base_dir)).status_code == 501
    client, _ = _client(base_dir, engine)
    assert client.post("/transfer_weights", json={**_body(base_dir), "version": -1}).status_code == 400
    assert client.post("/transfer_weights", json={**_body(base_dir), "init_info": []}).status_code == 400
    body = _body(base_dir)
    body["update_info"]["shapes"][0] = [1, 2]
    r = client.post("/transfer_weights", json=body)
    assert r.status_code == 422 and "shape" in r.json()["error"]
    body = _body(base_dir)
    body["update_info"]["names"][0] = "model.evil.weight"
    assert client.post("/transfer_weights", json=body).status_code == 422
    assert engine.calls == [], "nothing reaches the engine before validation passes"


@pytest.mark.parametrize(
    ("update", "match"),
    [({"wire_version": 1}, "weight-wire version 1"), ({"stacks": [[0, 10**9]]}, "stack")],
)
def test_another_wire_version_or_a_lying_stack_manifest_is_refused_before_pausing(base_dir, update, match):
    """Issue 47's wire version 2: a sender laying the bytes out another way, or a manifest of stacks out of
    range, is one 422 line; the server is never paused."""
    engine = FakeEngine()
    client, state = _client(base_dir, engine)
    r = client.post("/transfer_weights", json=_body(base_dir, **update))
    assert r.status_code == 422 and match in r.json()["error"], r.text
    assert engine.calls == [] and state.version == 0


def test_failed_transfer_restores_a_directory_or_stays_paused_and_unhealthy(base_dir):
    engine = FakeEngine()
    client, state = _client(base_dir, engine)
    engine.fail_transfer = True
    r = client.post("/transfer_weights", json=_body(base_dir))  # previous weights: the base directory
    assert r.status_code == 502 and "still serving version 0" in r.json()["error"]
    assert engine.calls[-3:] == [("load", str(base_dir)), ("reset",), ("resume",)]
    assert client.get("/liveness").status_code == 200

    engine.fail_transfer = False
    assert client.post("/transfer_weights", json=_body(base_dir, version=4, round_id="r2")).status_code == 200
    engine.fail_transfer, engine.calls = True, []
    r = client.post("/transfer_weights", json=_body(base_dir, version=5, round_id="r3"))
    assert r.status_code == 502 and "undefined" in r.json()["error"]
    assert engine.calls == [("pause",), ("transfer", "r3")], "no directory to restore: stays paused"
    assert client.get("/liveness").status_code == 503
    assert client.get("/weights_version").json()["version"] == -1

    # A full load (the orchestrator's filesystem fallback) makes the weights defined again and resumes.
    import shutil

    d = base_dir.parent / "step_5"
    shutil.copytree(base_dir, d, dirs_exist_ok=True)
    assert client.post("/update_weights", json={"weight_dir": str(d)}).status_code == 200
    assert engine.calls[-1] == ("resume",) and client.get("/liveness").status_code == 200
    assert state.version == 5 and state.transport == "filesystem"
