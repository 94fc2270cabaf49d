"""A new weight transport is one folder: a transport registered from this module (`mirror`: each step's broadcast
also copied to a second directory, loaded by the server through routes of its own) is picked by
`trainer.broadcast.mode`, built by `make_publisher` and served by the real admin routes app, with no edit
elsewhere (primejax/transports/weights/registry.py, docs/weight_transfer.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from primejax.inference.admin_auth import HEADER
from primejax.inference.routes import AdminState
from primejax.inference.server import ServerSpec
from primejax.inference.transport_routes import admin_router
from primejax.inference.vllm_ext import PrimejaxEndpointPlugin
from primejax.models.tiny import build_tiny_model
from primejax.transports.weights.config import BroadcastConfig
from primejax.transports.weights.filesystem.broadcast import is_stable, verify_broadcast
from primejax.transports.weights.registry import (
    TRANSPORT_ENV,
    Route,
    Transport,
    follower_for,
    lookup,
    register,
    unregister,
)
from primejax.transports.weights.validate import WeightDirValidator
from primejax.utils.sections import ConfigError
from tests.inference.recording_engine import RecordingEngine

TOKEN = "t" * 32


class MirrorPublisher:
    """The run's disk publisher, then a copy of its broadcast into `<run>/mirror/step_N`."""

    def __init__(self, disk, root: Path):
        self.disk, self.mirror = disk, root / "mirror"

    def publish(self, step, model, *, disk_only=False):
        metrics = self.disk.publish(step, model, disk_only=disk_only)
        self.mirror.mkdir(exist_ok=True)
        shutil.copytree(self.disk.run.broadcasts(step), self.mirror / f"step_{step}")
        return {**metrics, "mirror/steps": float(step)}


async def load_mirror(server, body):  # a directory through the filesystem update's own checks
    return await server.load_directory(body.get("weight_dir"), body.get("version"))


async def push_mirror(server, body):  # a load of the transport's own inside the update protocol
    weight_dir = body["weight_dir"]

    async def load(engine):
        if body.get("fail"):
            raise ConnectionError("mirror link dropped")
        await engine.load_weights(weight_dir)

    return await server.load_with(body.get("version"), "mirror", load)


class MirrorFollower:
    """The orchestrator's half: the newest complete mirror copy, delivered through the transport's own route."""

    def __init__(self, run_dir: Path):
        self.mirror = run_dir / "mirror"

    async def newest(self):
        steps = [int(p.name.split("_")[1]) for p in self.mirror.glob("step_*") if is_stable(p)]
        return max(steps, default=None)

    async def deliver(self, client, step):
        body = {"weight_dir": str(self.mirror / f"step_{step}"), "version": step}
        await client.post_admin("/mirror_weights", body)


MIRROR = Transport(
    "mirror",
    lambda ctx: MirrorPublisher(ctx.disk(), ctx.root),
    routes=(Route("/mirror_weights", load_mirror), Route("/mirror_push", push_mirror)),
    follower=MirrorFollower,
)


@pytest.fixture
def mirror():
    register(MIRROR)
    yield MIRROR
    unregister("mirror")


def test_mode_accepts_exactly_the_registered_transports(mirror):
    assert BroadcastConfig(mode="mirror").mode == "mirror"
    assert lookup("filesystem").name == "filesystem" and lookup("collective").name == "collective"
    unregister("mirror")
    for bad in ("mirror", "nccl", "adapters", "../filesystem", "Filesystem"):
        with pytest.raises(ConfigError, match=r"^mode: ") as e:
            BroadcastConfig(mode=bad)
        assert "\n" not in str(e.value)
    register(MIRROR)
    with pytest.raises(ValueError, match="registered already"):
        register(Transport("mirror", MIRROR.publisher))
    with pytest.raises(ValueError, match="transport name"):
        register(Transport("Bad-Name", MIRROR.publisher))


def test_a_folder_that_registers_itself_is_a_transport_with_no_other_edit(tmp_path, monkeypatch):
    """A folder beside filesystem/ and collective/ (here in a second directory of the package's path) is found
    by its name alone: `lookup` imports exactly that package, which registers it."""
    import primejax.transports.weights as weights

    folder = tmp_path / "probe_tx"
    folder.mkdir()
    (folder / "__init__.py").write_text(
        "from primejax.transports.weights.registry import Transport, register\n"
        "register(Transport('probe_tx', lambda ctx: ctx.disk()))\n"
    )
    monkeypatch.setattr(weights, "__path__", [*weights.__path__, str(tmp_path)])
    try:
        assert BroadcastConfig(mode="probe_tx").mode == "probe_tx"
        assert "primejax.transports.weights.probe_tx" in sys.modules
    finally:
        unregister("probe_tx")
        sys.modules.pop("primejax.transports.weights.probe_tx", None)


def test_make_publisher_builds_the_registered_transport(mirror, tmp_path):
    from primejax.models.hf_io import load_model
    from primejax.models.sharding import make_mesh
    from primejax.transports.weights.publish import make_publisher

    src = build_tiny_model(tmp_path / "base")
    model, cfg = load_model(src, mesh=make_mesh(fsdp=-1), param_dtype="float32")
    run = tmp_path / "run"
    pub = make_publisher(
        BroadcastConfig(mode="mirror", dtype="float32"),
        run,
        cfg,
        async_level=1,
        max_steps=5,
        checkpoint_interval=0,
        src_dir=str(src),
    )
    assert isinstance(pub, MirrorPublisher)
    assert pub.publish(1, model)["mirror/steps"] == 1.0
    a, b = run / "broadcasts" / "step_1", run / "mirror" / "step_1"
    verify_broadcast(b)  # STABLE and every file's sha256
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and any(f.endswith(".safetensors") for f in files)
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def _client(base_dir, weights_root):
    """The app as a vLLM server builds it: primejax's endpoint plugin attaches the admin routes."""
    app = FastAPI()
    PrimejaxEndpointPlugin().attach_router(app)
    engine = RecordingEngine()
    app.state.primejax = AdminState(
        engine=engine,
        base_dir=str(base_dir),
        validate=WeightDirValidator(base_dir),
        admin_token=TOKEN,
        weights_root=str(weights_root),
        require_stable=True,
    )
    return TestClient(app), engine, app.state.primejax


def _mirror_dir(base_dir, root, step):
    from primejax.transports.weights.filesystem.broadcast import write_broadcast

    return write_broadcast(root, step, lambda d: shutil.copytree(base_dir, d, dirs_exist_ok=True))[0]


def test_transport_routes_are_admin_routes_that_drive_the_update_protocol(mirror, tmp_path, monkeypatch):
    monkeypatch.setenv(TRANSPORT_ENV, "mirror")  # as ServerSpec.transport tells a server
    base = build_tiny_model(tmp_path / "base")
    root = tmp_path / "mirror"
    d = _mirror_dir(base, root, 4)
    client, engine, state = _client(base, root / "broadcasts")
    auth = {HEADER: TOKEN}

    assert client.post("/mirror_weights", json={"weight_dir": str(d), "version": 4}).status_code == 401
    r = client.post("/mirror_weights", json={"weight_dir": str(d), "version": 4}, headers=auth)
    assert r.status_code == 200 and r.json()["version"] == 4 and r.json()["transport"] == "filesystem"
    assert engine.calls == [("pause",), ("load", str(d)), ("reset",), ("resume",)]

    engine.calls.clear()  # refused before anything is touched: outside the root, no body, a bad version
    outside = _mirror_dir(base, tmp_path / "elsewhere", 5)
    for body, status in (
        ({"weight_dir": str(outside), "version": 5}, 403),
        ({"weight_dir": str(d), "version": -1}, 400),
        ({"version": 5}, 400),
    ):
        assert client.post("/mirror_weights", json=body, headers=auth).status_code == status
    assert client.post("/mirror_weights", content=b"[1", headers=auth).status_code == 400
    assert engine.calls == [] and state.version == 4

    r = client.post("/mirror_push", json={"weight_dir": str(d), "version": 6}, headers=auth)
    assert r.status_code == 200 and (r.json()["version"], r.json()["transport"]) == (6, "mirror")

    engine.calls.clear()  # a failed load answers one line and the server keeps serving version 6
    r = client.post("/mirror_push", json={"weight_dir": str(d), "version": 7, "fail": True}, headers=auth)
    assert (
        r.status_code == 502 and "mirror link dropped" in r.json()["error"] and "\n" not in r.json()["error"]
    )
    # the weights came by no directory, so nothing to restore: unhealthy, paused, until a full update
    assert client.get("/weights_version").json()["version"] == -1
    assert engine.calls == [("pause",)]
    r = client.post("/mirror_push", json={"version": 8}, headers=auth)  # the handler's own bug: 500, one line
    assert r.status_code == 500 and "KeyError" in r.json()["error"]


def test_the_orchestrator_delivers_a_transports_updates_through_its_follower(mirror, tmp_path, monkeypatch):
    """The run's transport brings the orchestrator's half (`follower`): the real watcher asks it for its newest
    step and has it call the transport's own route on the server (the real routes app, reached by the real
    client). A failed delivery is not retried: the step's broadcast is loaded instead, by the filesystem route."""
    import asyncio

    import httpx

    from primejax.inference.client import InferenceClient
    from primejax.orchestrator.policy import PolicyTracker

    monkeypatch.setenv(TRANSPORT_ENV, "mirror")
    base = build_tiny_model(tmp_path / "base")
    run = tmp_path / "run"
    for step in (1, 2):  # the publisher's two copies of each step: broadcasts/ and mirror/
        _mirror_dir(base, run, step)
        shutil.copytree(run / "broadcasts" / f"step_{step}", run / "mirror" / f"step_{step}")
    http, engine, state = _client(base, run)
    assert follower_for("filesystem", run) is None and follower_for("collective", run) is None
    name, follower = follower_for("mirror", run)

    async def scenario():
        transport = httpx.ASGITransport(app=http.app)
        async with InferenceClient("http://server", transport=transport, admin_token=TOKEN) as client:
            tracker = PolicyTracker(client, run, follower=(name, follower))
            assert await tracker.refresh() and tracker.version == 2
            assert tracker.update_events[-1].transport == "mirror"
            assert engine.calls[1] == ("load", str(run / "mirror" / "step_2"))

            _mirror_dir(base, run, 3)  # its mirror copy is outside the server's weights root: refused
            bad = tmp_path / "outside" / "step_3"
            shutil.copytree(run / "broadcasts" / "step_3", bad)
            (run / "mirror" / "step_3").symlink_to(bad, target_is_directory=True)
            engine.calls.clear()
            assert not await tracker.refresh() and tracker.failed_follows == {3} and tracker.version == 2
            assert await tracker.refresh() and tracker.version == 3  # not retried: the broadcast instead
            assert tracker.update_events[-1].transport == "filesystem"
            assert ("load", str(run / "broadcasts" / "step_3")) in engine.calls

    asyncio.run(scenario())
    assert state.version == 3


def test_a_transport_route_may_not_shadow_a_server_route(tmp_path):
    register(clash := Transport("clash", MIRROR.publisher, routes=(Route("/update_weights", load_mirror),)))
    try:
        with pytest.raises(ValueError, match="/update_weights is taken"):
            admin_router()
    finally:
        unregister(clash.name)


def test_the_server_is_told_the_runs_transport():
    env = ServerSpec(model="m", transport="mirror").environ({})
    assert env[TRANSPORT_ENV] == "mirror" and TRANSPORT_ENV not in ServerSpec(model="m").environ({})


def test_the_registry_and_the_config_section_import_no_backend():
    code = (
        "import sys; from primejax.transports.weights.config import BroadcastConfig; "
        "BroadcastConfig(mode='collective'); print(sorted(m for m in ('jax', 'flax', 'torch', 'fastapi') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
