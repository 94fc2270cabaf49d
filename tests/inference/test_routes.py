"""primejax's admin routes against a recording fake engine: protocol order, versions, error codes."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from primejax.inference.routes import AdminState, router
from primejax.models.tiny import build_tiny_model
from primejax.transports.weights.validate import WeightDirValidator
from tests.inference.recording_engine import RecordingEngine


class FakeEngine(RecordingEngine):
    def __init__(self, fail_on: str | None = None):
        super().__init__()
        self.fail_on = fail_on

    async def load_weights(self, weight_dir):
        await super().load_weights(weight_dir)
        if self.fail_on and weight_dir.endswith(self.fail_on):
            raise RuntimeError("disk vanished")

    async def check_health(self):
        self.calls.append(("health",))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("routes") / "base")


def _client(base_dir, engine) -> tuple[TestClient, AdminState]:
    app = FastAPI()
    app.include_router(router)
    app.state.primejax = AdminState(
        engine=engine, base_dir=str(base_dir), validate=WeightDirValidator(base_dir)
    )
    return TestClient(app), app.state.primejax


def _step_dir(base_dir, tmp_path, n):
    import shutil

    d = tmp_path / f"step_{n}"
    shutil.copytree(base_dir, d)
    return d


def test_update_pauses_loads_resets_resumes_and_publishes_version(base_dir, tmp_path):
    engine = FakeEngine()
    client, _ = _client(base_dir, engine)
    d = _step_dir(base_dir, tmp_path, 7)
    r = client.post("/update_weights", json={"weight_dir": str(d)})
    assert r.status_code == 200 and r.json()["version"] == 7 and r.json()["weight_dir"] == str(d)
    assert engine.calls == [("pause",), ("load", str(d)), ("reset",), ("resume",)]
    assert client.get("/weights_version").json()["version"] == 7


def test_explicit_version_wins_over_dir_name(base_dir, tmp_path):
    client, _ = _client(base_dir, FakeEngine())
    d = _step_dir(base_dir, tmp_path, 7)
    assert client.post("/update_weights", json={"weight_dir": str(d), "version": 12}).json()["version"] == 12


def test_reload_returns_to_base_version_zero(base_dir, tmp_path):
    engine = FakeEngine()
    client, _ = _client(base_dir, engine)
    client.post("/update_weights", json={"weight_dir": str(_step_dir(base_dir, tmp_path, 2))})
    r = client.post("/reload_weights")
    assert r.json()["version"] == 0 and r.json()["weight_dir"] == str(base_dir)
    assert engine.calls[-3:] == [("load", str(base_dir)), ("reset",), ("resume",)]


@pytest.mark.parametrize(
    "body,status,fragment",
    [
        ({}, 400, "weight_dir"),
        ({"weight_dir": "/nonexistent/step_3"}, 404, "does not exist"),
        ({"weight_dir": "/tmp/no_step_name"}, 400, "cannot tell the weight version"),
        ({"weight_dir": "/nonexistent/step_3", "version": -1}, 400, "version"),
        ({"weight_dir": "/nonexistent/step_3", "version": True}, 400, "version"),
    ],
)
def test_bad_requests_are_4xx_and_touch_nothing(base_dir, body, status, fragment):
    engine = FakeEngine()
    client, state = _client(base_dir, engine)
    r = client.post("/update_weights", json=body)
    assert r.status_code == status and fragment in r.json()["error"]
    assert engine.calls == [] and state.version == 0


def test_non_json_body_is_400(base_dir):
    client, _ = _client(base_dir, FakeEngine())
    r = client.post("/update_weights", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_failed_load_restores_previous_weights_and_version(base_dir, tmp_path):
    engine = FakeEngine(fail_on="step_5")
    client, state = _client(base_dir, engine)
    good = _step_dir(base_dir, tmp_path, 4)
    client.post("/update_weights", json={"weight_dir": str(good)})
    engine.calls.clear()
    r = client.post("/update_weights", json={"weight_dir": str(_step_dir(base_dir, tmp_path, 5))})
    assert r.status_code == 500 and "still serving version 4" in r.json()["error"]
    assert engine.calls[-3:] == [("load", str(good)), ("reset",), ("resume",)]
    assert state.version == 4 and state.weight_dir == str(good)


def test_update_while_user_paused_stays_paused(base_dir, tmp_path):
    engine = FakeEngine()
    client, _ = _client(base_dir, engine)
    client.post("/pause")
    client.post("/update_weights", json={"weight_dir": str(_step_dir(base_dir, tmp_path, 1))})
    assert ("resume",) not in engine.calls
    client.post("/resume")
    assert engine.calls[-1] == ("resume",)


def test_liveness_reports_unhealthy_engine_as_503(base_dir):
    class Dead(FakeEngine):
        async def check_health(self):
            raise RuntimeError("engine core died")

    client, _ = _client(base_dir, Dead())
    r = client.get("/liveness")
    assert r.status_code == 503 and "engine core died" in r.json()["error"]
    assert _client(base_dir, FakeEngine())[0].get("/liveness").status_code == 200


def test_init_broadcaster_is_501(base_dir):
    assert _client(base_dir, FakeEngine())[0].post("/init_broadcaster").status_code == 501
