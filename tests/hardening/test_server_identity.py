"""The run talks only to servers it started: an impostor on the server's address (a program answering 200 to
everything, or another run's primejax server) gets no sampling or admin request, and the run says why in one
line; with the default `inference.port = 0` two runs never meet on one port."""

from __future__ import annotations

import asyncio
import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from primejax.inference.admin_auth import TOKEN_ENV, protect
from primejax.inference.client import InferenceClient
from primejax.inference.identity import ServerIdentityError
from primejax.inference.routes import AdminState, router

ROOT = Path(__file__).resolve().parents[2]
SECRET = "this-run"


class _Answer200(http.server.BaseHTTPRequestHandler):
    """A stranger's server: 200 and a plain body to every request; records what it was asked."""

    seen: list[str]

    def _answer(self) -> None:
        self.seen.append(f"{self.command} {self.path.split('?')[0]}")
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"ok")

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def impostor():
    seen: list[str] = []
    handler = type("H", (_Answer200,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def _primejax_app(secret: str) -> FastAPI:
    class Engine:
        async def check_health(self):
            pass

    app = FastAPI()
    app.include_router(router)
    protect(app, router)
    app.state.primejax = AdminState(
        engine=Engine(), base_dir="/m", validate=lambda d: None, admin_token=secret
    )
    return app


def test_a_server_answering_200_to_everything_gets_one_line_and_no_request(impostor):
    url, seen = impostor

    async def go():
        async with InferenceClient(url, admin_token=SECRET, max_retries=0) as c:
            with pytest.raises(ServerIdentityError) as e:
                await c.wait_ready(10)
            with pytest.raises(ServerIdentityError):
                await c.generate([1, 2, 3], n=1, max_tokens=4, temperature=1.0)
            with pytest.raises(ServerIdentityError):
                await c.pause()
            return str(e.value)

    line = asyncio.run(go())
    assert "\n" not in line and f"the server at {url} is not this run's inference server" in line
    assert all(s.startswith("GET /liveness") or s.startswith("GET /identity") for s in seen), seen


@pytest.mark.parametrize("server_secret", ["another-run", SECRET])
def test_another_runs_primejax_server_is_refused_and_the_own_is_accepted(server_secret):
    transport = httpx.ASGITransport(app=_primejax_app(server_secret))

    async def go():
        async with InferenceClient("http://srv", admin_token=SECRET, transport=transport, max_retries=0) as c:
            await c.wait_ready(10)
            return await c.weights_version()

    if server_secret == SECRET:
        assert asyncio.run(go()) == 0
    else:
        with pytest.raises(ServerIdentityError, match="does not hold this run's admin secret"):
            asyncio.run(go())


def test_the_launchers_health_watch_does_not_count_an_impostors_200(impostor):
    from primejax.launcher.supervisor import Liveness

    url, _ = impostor
    watch = Liveness(url, SECRET)
    watch.start()
    try:
        deadline = time.monotonic() + 30
        while not watch.impostor:
            assert time.monotonic() < deadline, "the watch never judged the server"
            time.sleep(0.05)  # polling the watch thread's verdict; it ends on the verdict
        assert watch.last_ok is None and "not this run's inference server" in watch.impostor
    finally:
        watch.stop()


def test_standalone_orchestrator_refuses_an_impostor_in_one_line(impostor, tmp_path, tiny_model_dir):
    url, seen = impostor
    port = url.rsplit(":", 1)[1]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "primejax.orchestrator",
            "--config",
            "configs/debug.py",
            f"--config.run.output_dir={tmp_path}",
            "--config.run.name=r",
            f"--config.model.path={tiny_model_dir}",
            f"--config.inference.port={port}",
            "--config.run.max_steps=1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, TOKEN_ENV: SECRET, "JAX_PLATFORMS": "cpu"},
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert last.startswith("error: orchestrator: the server at") and "not this run's" in last, last
    assert "Traceback" not in proc.stderr
    assert all(s.startswith("GET /liveness") or s.startswith("GET /identity") for s in seen), seen


def test_orchestrator_alone_with_port_zero_says_what_to_set(tmp_path):
    from primejax.config import default_config
    from primejax.orchestrator.run import base_urls
    from primejax.utils.sections import ConfigError

    c = default_config()
    assert c.inference.port == 0
    with pytest.raises(ConfigError, match="inference.port"):
        base_urls(c.orchestrator.client, c.inference)
