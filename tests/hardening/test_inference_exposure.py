"""The inference server's admin routes: a secret on every POST, loads confined to one tree (symlinks resolved),
STABLE manifests verified by the server, absolute paths only, and a failed load that could not restore the
previous weights marks the server unhealthy. Routes against a recording fake engine, plus the real server."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import urllib.error
import urllib.request

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from primejax.inference.admin_auth import HEADER, TOKEN_ENV, protect
from primejax.inference.client import InferenceClient
from primejax.inference.identity import proof
from primejax.inference.routes import AdminState, router
from primejax.models.tiny import build_tiny_model
from primejax.transports.weights.filesystem.broadcast import write_broadcast
from primejax.transports.weights.validate import WeightDirValidator
from tests.inference.recording_engine import RecordingEngine

SECRET = "s3cret-for-tests"


class FakeEngine(RecordingEngine):
    def __init__(self, fail: tuple[str, ...] = ()):
        super().__init__()
        self.fail = fail

    async def load_weights(self, weight_dir):
        await super().load_weights(weight_dir)
        if any(weight_dir.endswith(f) for f in self.fail):
            raise RuntimeError("device lost")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("exposure") / "base")


def _client(base_dir, engine=None, **state) -> tuple[TestClient, AdminState]:
    app = FastAPI()
    app.include_router(router)
    protect(app, router)
    app.state.primejax = AdminState(
        engine=engine or FakeEngine(),
        base_dir=str(base_dir),
        validate=WeightDirValidator(base_dir),
        admin_token=SECRET,
        **state,
    )
    return TestClient(app), app.state.primejax


AUTH = {HEADER: SECRET}


def _broadcast(base_dir, run, step):
    def copy(d):
        for p in base_dir.iterdir():
            shutil.copy(p, d / p.name)

    return write_broadcast(run, step, copy)[0]


@pytest.mark.parametrize(
    "path", ["/update_weights", "/reload_weights", "/pause", "/resume", "/init_broadcaster"]
)
def test_admin_routes_need_the_secret(base_dir, path):
    client, _ = _client(base_dir)
    assert client.post(path, json={}).status_code == 401
    assert client.post(path, json={}, headers={HEADER: "wrong"}).status_code == 401
    assert client.post(path, json={}, headers=AUTH).status_code != 401
    assert client.get("/liveness").status_code == 200 and client.get("/weights_version").status_code == 200


def test_loads_are_confined_to_the_root_after_resolving_symlinks(base_dir, tmp_path):
    run = tmp_path / "run"
    good = _broadcast(base_dir, run, 1)
    outside = tmp_path / "elsewhere" / "step_99"
    shutil.copytree(base_dir, outside)
    (run / "broadcasts" / "step_99").symlink_to(outside)  # a step_N inside the root pointing out of it
    engine = FakeEngine()
    client, state = _client(base_dir, engine, weights_root=str(run / "broadcasts"))
    r = client.post("/update_weights", json={"weight_dir": str(run / "broadcasts" / "step_99")}, headers=AUTH)
    assert r.status_code == 403 and "outside" in r.json()["error"]
    missing = client.post("/update_weights", json={"weight_dir": "/nonexistent/step_3"}, headers=AUTH)
    present = client.post("/update_weights", json={"weight_dir": str(outside)}, headers=AUTH)
    assert missing.status_code == present.status_code == 403  # no answer tells which paths exist
    rel = client.post("/update_weights", json={"weight_dir": "run/broadcasts/step_1"}, headers=AUTH)
    assert rel.status_code == 400 and "absolute" in rel.json()["error"]
    assert not [c for c in engine.calls if c[0] == "load"]
    assert client.post("/update_weights", json={"weight_dir": str(good)}, headers=AUTH).status_code == 200
    assert state.version == 1


def test_stable_manifest_is_checked_by_the_server(base_dir, tmp_path):
    run = tmp_path / "run"
    d = _broadcast(base_dir, run, 2)
    weights = next(d.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-4:] = b"\xff\xff\xff\x7f"  # same size, different bytes (a NaN where a weight was)
    weights.write_bytes(bytes(data))
    engine = FakeEngine()
    client, state = _client(base_dir, engine, weights_root=str(run / "broadcasts"), require_stable=True)
    r = client.post("/update_weights", json={"weight_dir": str(d)}, headers=AUTH)
    assert r.status_code == 422 and "STABLE" in r.json()["error"] and "sha256" in r.json()["error"]
    bare = run / "broadcasts" / "step_3"
    shutil.copytree(base_dir, bare)  # no STABLE manifest: an incomplete or hand-made directory
    r = client.post("/update_weights", json={"weight_dir": str(bare)}, headers=AUTH)
    assert r.status_code == 422 and "STABLE" in r.json()["error"]
    assert not [c for c in engine.calls if c[0] == "load"] and state.version == 0


def test_a_load_that_cannot_restore_marks_the_server_unhealthy(base_dir, tmp_path):
    run = tmp_path / "run"
    one, two = _broadcast(base_dir, run, 1), _broadcast(base_dir, run, 2)
    engine = FakeEngine()
    client, _ = _client(base_dir, engine)
    assert client.post("/update_weights", json={"weight_dir": str(one)}, headers=AUTH).status_code == 200
    engine.fail = ("step_1", "step_2")  # the new load fails, and so does putting step 1 back
    r = client.post("/update_weights", json={"weight_dir": str(two)}, headers=AUTH)
    assert r.status_code == 500 and "undefined" in r.json()["error"]
    assert client.get("/liveness").status_code == 503
    assert client.get("/weights_version").json()["version"] == -1


def test_unauthenticated_gets_do_not_reveal_absolute_paths(base_dir, tmp_path):
    """Issue 48: GET /weights_version and /liveness (open to anyone) named the served directory's absolute path,
    and an unhealthy server's reason (which names paths). The secret's holders still see both."""
    run = tmp_path / "run"
    one, two = _broadcast(base_dir, run, 1), _broadcast(base_dir, run, 2)
    engine = FakeEngine()
    client, _ = _client(base_dir, engine)
    assert client.post("/update_weights", json={"weight_dir": str(one)}, headers=AUTH).status_code == 200
    for route in ("/weights_version", "/liveness"):
        assert client.get(route).json()["weight_dir"] == "step_1", route
        assert client.get(route, headers=AUTH).json()["weight_dir"] == str(one), route
    engine.fail = ("step_1", "step_2")
    client.post("/update_weights", json={"weight_dir": str(two)}, headers=AUTH)
    anyone, admin = client.get("/liveness"), client.get("/liveness", headers=AUTH)
    assert anyone.status_code == admin.status_code == 503
    assert str(tmp_path) not in anyone.text and str(tmp_path) in admin.text


def test_client_sends_absolute_paths_and_the_secret_on_admin_calls_only(tmp_path, monkeypatch):
    seen = []

    def handler(req):
        if req.url.path == "/identity":  # the run's own server answers the challenge
            return httpx.Response(200, json={"proof": proof(SECRET, req.url.params["nonce"])})
        seen.append((req.url.path, req.headers.get(HEADER), json.loads(req.content or b"null")))
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if req.url.path == "/v1/completions":
            return httpx.Response(
                200,
                json={
                    "choices": [
                        {
                            "index": 0,
                            "token_ids": [1],
                            "text": "x",
                            "finish_reason": "stop",
                            "logprobs": {"token_logprobs": [-0.1]},
                        }
                    ]
                },
            )
        return httpx.Response(200, json={"version": 3})

    monkeypatch.chdir(tmp_path)

    async def go():
        c = InferenceClient("http://srv:1", transport=httpx.MockTransport(handler), admin_token=SECRET)
        await c.update_weights("runs/r/broadcasts/step_3", 3)
        await c.generate([1, 2], n=1, max_tokens=1, temperature=1.0)
        await c.close()

    asyncio.run(go())
    update = next(s for s in seen if s[0] == "/update_weights")
    assert update[1] == SECRET and update[2]["weight_dir"] == str(tmp_path / "runs/r/broadcasts/step_3")
    assert all(h is None for p, h, _ in seen if p.startswith("/v1/"))


@pytest.mark.vllm
def test_real_server_refuses_admin_calls_without_the_secret(vllm_server):
    for path in ("/pause", "/update_weights", "/reload_weights"):
        req = urllib.request.Request(
            vllm_server.base_url + path,
            data=b"{}",
            method="POST",
            headers={"content-type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 401
    req = urllib.request.Request(vllm_server.base_url + "/weights_version")
    assert json.loads(urllib.request.urlopen(req, timeout=30).read())["version"] == 0
    assert os.environ.get(TOKEN_ENV)  # the session's secret, which its clients send


ADMIN_ROUTES = sorted(r.path for r in router.routes if "POST" in getattr(r, "methods", ()))


@pytest.mark.parametrize("root_path", ["/api", "/a/b"])
@pytest.mark.parametrize("path", ADMIN_ROUTES)
def test_admin_routes_need_the_secret_under_a_root_path(base_dir, root_path, path):
    """vLLM's --root-path puts a prefix in the URL that the route paths lack: every admin route still asks for
    the secret, reached with the prefix or without (Starlette routes both)."""
    app = FastAPI(root_path=root_path)
    app.include_router(router)
    protect(app, router)
    engine = FakeEngine()
    app.state.primejax = AdminState(
        engine=engine, base_dir=str(base_dir), validate=WeightDirValidator(base_dir), admin_token=SECRET
    )
    client = TestClient(app)
    for url in (root_path + path, path):
        assert client.post(url, json={}).status_code == 401, url
        assert client.post(url, json={}, headers={HEADER: "wrong"}).status_code == 401, url
    assert engine.calls == []
    assert client.post(root_path + path, json={}, headers=AUTH).status_code != 401
    assert client.get(root_path + "/liveness").status_code == 200


# issue 48: the malformed ones (not UTF-8, not an object, a size that is no size, a name outside the directory)
# answered HTTP 500 or made the server hash a file outside the broadcast
@pytest.mark.parametrize(
    "damage",
    [
        "no_files",
        "no_hashes",
        "unlisted_weights",
        "not_utf8",
        "not_an_object",
        "deep",
        "no_size",
        "string_size",
        "outside",
    ],
)
def test_a_stable_manifest_that_vouches_for_nothing_is_refused(base_dir, tmp_path, damage):
    run = tmp_path / "run"
    d = _broadcast(base_dir, run, 2)
    manifest = json.loads((d / "STABLE").read_text())
    weights = next(n for n in manifest["files"] if n.endswith(".safetensors"))
    if damage == "no_files":
        manifest["files"] = {}
    elif damage == "no_hashes":
        for entry in manifest["files"].values():
            entry.pop("sha256")
    elif damage == "unlisted_weights":
        del manifest["files"][weights]
    elif damage == "no_size":
        manifest["files"][weights].pop("size")
    elif damage == "string_size":
        manifest["files"][weights]["size"] = "12"
    elif damage == "outside":
        outside = tmp_path / "elsewhere.safetensors"
        outside.write_bytes(b"x")
        manifest["files"]["../../../elsewhere.safetensors"] = {"size": 1, "sha256": "0" * 64}
    raw = {"not_utf8": b"\xff\xfe{", "not_an_object": b"[1, 2]", "deep": b"[" * 100_000}.get(damage)
    (d / "STABLE").write_bytes(raw if raw is not None else json.dumps(manifest).encode())
    engine = FakeEngine()
    client, state = _client(base_dir, engine, weights_root=str(run / "broadcasts"), require_stable=True)
    r = client.post("/update_weights", json={"weight_dir": str(d)}, headers=AUTH)
    assert r.status_code == 422 and "STABLE" in r.json()["error"], r.text
    assert not [c for c in engine.calls if c[0] == "load"] and state.version == 0


class TransferEngine(FakeEngine):
    async def transfer_weights(self, init_info, update_info):
        self.calls.append(("transfer",))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype_names", "float64"),
        ("dtype_names", ["x"]),
        ("shapes", [["a"]]),
        ("shapes", [[-1]]),
        # issue 48: an infinite dimension (JSON's Infinity) answered HTTP 500; a string or bool passed as a number
        ("shapes", [[float("inf")]]),
        ("shapes", [["2"]]),
        ("shapes", [[True]]),
    ],
)
def test_a_malformed_transfer_offer_is_refused_before_the_server_pauses(base_dir, field, value):
    validator = WeightDirValidator(base_dir)
    engine = TransferEngine()
    client, state = _client(base_dir, engine, check_transfer=validator.check_update_info)
    names = sorted(validator.reference)
    info = {
        "round_id": "1-x",
        "wire_version": 2,
        "names": names,
        "dtype_names": ["float32"] * len(names),
        "shapes": [list(validator.reference[n].shape) for n in names],
    }
    info[field] = value if not isinstance(value, list) else value * len(names)
    body = {"version": 1, "init_info": {"timeout_s": 5}, "update_info": info}
    # json.dumps writes inf as `Infinity`, which Python's JSON reader (the server's) accepts
    r = client.post(
        "/transfer_weights", content=json.dumps(body), headers={**AUTH, "content-type": "application/json"}
    )
    assert r.status_code in (400, 422), r.text
    assert engine.calls == [] and state.version == 0


def test_the_client_sends_the_servers_api_key_from_the_configured_variable(monkeypatch):
    """The README's advice (protect the OpenAI routes with vLLM's --api-key / $VLLM_API_KEY) works with
    primejax's own client: it sends the key named by orchestrator.client.api_key_env on every call."""
    from primejax.config import default_config, typed
    from primejax.orchestrator.run import policy_client

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv("MY_VLLM_KEY", "k-123")
    seen = []

    def handler(req):
        seen.append((req.url.path, req.headers.get("Authorization")))
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(
            200,
            json={
                "choices": [
                    {
                        "index": 0,
                        "token_ids": [1],
                        "text": "x",
                        "finish_reason": "stop",
                        "logprobs": {"token_logprobs": [-0.1]},
                    }
                ]
            },
        )

    c = default_config()
    c.model.path = "m"
    c.inference.port = 1
    c.orchestrator.client.api_key_env = "MY_VLLM_KEY"
    cfg = typed(c)
    client = policy_client(cfg.orchestrator.client, cfg.inference)
    client._http._transport = httpx.MockTransport(handler)

    async def go():
        await client.generate([1, 2], n=1, max_tokens=1, temperature=1.0)
        await client.close()

    asyncio.run(go())
    assert seen and all(auth == "Bearer k-123" for _, auth in seen)


def test_a_server_started_by_hand_uses_the_runs_admin_token(tmp_path, monkeypatch):
    from primejax.inference.admin_auth import read_token, server_token, write_run_token

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    made = server_token(tmp_path / "run")  # no secret anywhere yet: one is made and recorded for the run
    assert (
        read_token(tmp_path / "run") == made
        and (tmp_path / "run" / "admin_token").stat().st_mode & 0o077 == 0
    )
    assert server_token(tmp_path / "run") == made  # the next server (or orchestrator) by hand reads the same
    written = write_run_token(tmp_path / "other")
    assert server_token(tmp_path / "other") == written
