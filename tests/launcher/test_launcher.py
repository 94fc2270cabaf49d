"""The launcher under failure: a child killed mid-run, and bad input caught before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fault_harness import REPO, assert_no_survivors, reload_base_weights, run_dir_of, write_config

from primejax.contracts.batch import PackedBatch, write_batch


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): a whole run; the default tier's child kill: tests/faults
def test_orchestrator_killed_mid_run_stops_everything(vllm_server, tmp_path):
    """kill -9 of the orchestrator child: the launcher stops the others and exits non-zero within 30 s, naming
    the orchestrator and showing its log tail; no process of the run survives."""
    config = write_config(
        tmp_path, "orch_sigkill", vllm_server.model_dir, base_url=vllm_server.base_url, max_steps=50
    )
    root = run_dir_of(config)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "primejax.train", "--config", str(config)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        metrics = root / "metrics" / "trainer.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 300, "the first trainer step")
        pids = json.loads((root / "pids.json").read_text())
        os.kill(pids["orchestrator"], signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = launcher.communicate(timeout=60)
        took = time.monotonic() - killed_at
        print(f"launcher exited {took:.1f} s after the orchestrator was killed")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        reload_base_weights(vllm_server.base_url)
    assert launcher.returncode == 1, output[-3000:]
    assert took < 30.0, f"launcher took {took:.1f} s to exit"
    assert "primejax: orchestrator failed (exit status -9)" in output
    assert f"--- last lines of {root / 'logs' / 'orchestrator.log'} ---" in output
    assert "resumed orchestrator" not in output and "INFO" in output.split("--- last lines of")[1]  # the tail
    assert_no_survivors(root)
    for name, pid in pids.items():
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0) if name != "launcher" else os.kill(pid, 0)


def _run(config: Path, *overrides: str, module: str = "primejax.train") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, "--config", str(config), *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        start_new_session=True,
    )


def _copy_model(src: Path, dst: Path, drop: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name not in drop:
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _earlier_outputs(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_relative_to(root / "configs") and p.name != ".lock"
    }  # written by each invocation


@pytest.mark.parametrize(
    "case",
    [
        "no_config_json",
        "no_weights",
        "no_chat_template",
        "env_not_importable",
        "bad_value",
        "unknown_key",
        "resume_missing_step",
        "context_too_long",
        "judge_model_missing",
        "server_refuses_fp8",
    ],
)
def test_bad_input_one_line_exit_2_outputs_intact(tiny_model_dir, tmp_path, case):
    model = tiny_model_dir
    overrides: list[str] = []
    if case == "no_config_json":
        model = _copy_model(tiny_model_dir, tmp_path / "m", drop=("config.json",))
    elif case == "no_weights":
        model = _copy_model(
            tiny_model_dir, tmp_path / "m", drop=tuple(p.name for p in tiny_model_dir.glob("*.safetensors"))
        )
    elif case == "no_chat_template":
        model = _copy_model(tiny_model_dir, tmp_path / "m", drop=("chat_template.jinja",))
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    elif case == "env_not_importable":
        overrides = ["--config.orchestrator.envs.reverse_text.id=no_such_pkg.tasks:load"]
    elif case == "bad_value":
        overrides = ["--config.orchestrator.group_size=-4"]
    elif case == "unknown_key":
        overrides = ["--config.trainer.optim.learning_rate=1e-3"]
    elif case == "resume_missing_step":
        overrides = ["--config.run.resume_step=7"]
    elif case == "context_too_long":  # issue 48: vLLM's validation traceback, a minute in
        model = _copy_model(tiny_model_dir, tmp_path / "m")
        hf = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 512}))
        overrides = ["--config.inference.max_model_len=1024"]
    elif case == "judge_model_missing":  # the judge's own server would fail its start max_restarts times
        overrides = ["--config.judge.enabled=True", f"--config.judge.model_path={tmp_path / 'no-judge'}"]
    elif (
        case == "server_refuses_fp8"
    ):  # the server's own refusal came after the SFT warm-up, once per restart
        overrides = ["--config.inference.quantization=fp8"]
    # the serving checks are about the server the launcher starts: only these cases have one
    own_server = case in ("context_too_long", "server_refuses_fp8")
    config = write_config(tmp_path, "bad", model, base_url="" if own_server else "http://127.0.0.1:9", port=0)
    root = run_dir_of(config)
    (root / "metrics").mkdir(parents=True)
    (root / "metrics" / "trainer.jsonl").write_text('{"step": 1, "time": 0, "loss": 0.5}\n')
    (root / "checkpoints" / "step_1" / "orchestrator").mkdir(parents=True)
    (root / "checkpoints" / "step_1" / "orchestrator" / "state.json").write_text("{}")
    before = _earlier_outputs(root)

    proc = _run(config, *overrides)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    expected = {
        "no_config_json": "no config.json",
        "no_weights": "no *.safetensors",
        "no_chat_template": "no chat template",
        "env_not_importable": "no_such_pkg",
        "bad_value": "orchestrator.group_size",
        "unknown_key": "learning_rate",
        "resume_missing_step": "run.resume_step: step 7",
        "context_too_long": "inference.max_model_len: 1024 is longer than the model's max_position_embeddings "
        "512",
        "judge_model_missing": f"judge.model_path: {str(tmp_path / 'no-judge')!r} is not a directory",
        "server_refuses_fp8": "inference.quantization='fp8' needs a GPU vLLM",
    }[case]
    assert expected in lines[0]
    assert _earlier_outputs(root) == before
    assert not (root / "logs").exists() and not (root / "pids.json").exists()  # nothing was started


def test_a_server_that_refuses_its_arguments_is_not_restarted(tmp_path):
    """Exit status 2 is a server refusing its arguments (primejax's entry point, vLLM's parser): the same
    arguments would be refused again, so the supervisor stops the run at once instead of restarting it."""
    from primejax.inference.server import InferenceConfig
    from primejax.launcher.supervisor import REFUSED_EXIT, ChildFailed, InferenceSupervisor
    from primejax.utils.procs import ChildProcess

    starts: list[ChildProcess] = []

    def start() -> ChildProcess:
        code = f"import sys; print('error: refused'); sys.exit({REFUSED_EXIT})"
        starts.append(ChildProcess("inference", [sys.executable, "-c", code], tmp_path / "inference.log"))
        return starts[-1]

    inf = InferenceConfig(port=9, max_restarts=3)
    supervisor = InferenceSupervisor(start, inf, on_restart=lambda child: None)
    try:
        starts[0].popen.wait(timeout=60)
        with pytest.raises(ChildFailed, match="refused its arguments") as e:
            supervisor.check()
        assert e.value.code == REFUSED_EXIT and len(starts) == 1 and supervisor.restarts == 0
    finally:
        supervisor.stop()


def test_trainer_rejects_batch_with_mismatched_lengths(tiny_model_dir, tmp_path):
    """A batch whose fields disagree in length stops the trainer with one line naming the file and field,
    before any step: no metrics row, no broadcast, no checkpoint."""
    config = write_config(tmp_path, "bad_batch", tiny_model_dir, base_url="http://127.0.0.1:9", max_steps=1)
    root = run_dir_of(config)
    batch = PackedBatch.empty(4, 128)
    batch.loss_mask = np.zeros((4, 100), bool)  # 100 != seq_len 128
    step_dir = root / "rollouts" / "step_1"
    # write_batch itself refuses the mismatch; write the arrays raw, as a buggy or foreign writer would.
    with pytest.raises(ValueError, match="loss_mask"):
        write_batch(step_dir, 0, batch)
    good = PackedBatch.empty(4, 128)
    write_batch(step_dir, 0, good)
    data = dict(np.load(step_dir / "rank_0.npz"))
    data["loss_mask"] = np.zeros((4, 100), bool)
    np.savez(step_dir / "rank_0.npz", **data)

    proc = _run(config, module="primejax.trainer")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: trainer: BatchFormatError: ")
        and "rank_0.npz: field 'loss_mask': shape" in last
    )
    assert (
        not (root / "metrics" / "trainer.jsonl").exists()
        or not (root / "metrics" / "trainer.jsonl").read_text()
    )
    assert not (root / "broadcasts").exists() and not (root / "checkpoints").exists()


@pytest.mark.slow  # one real train step (the tiny model's first compile: ~30 s on 2 cores)
def test_an_eio_while_exporting_is_one_line_naming_the_broadcast(tiny_model_dir, tmp_path):
    """Issue 48: an EIO while the trainer exported ended in a traceback (the disk-full line's wording is
    tests/hardening/test_disk_full.py's)."""
    fault = "eio"
    config = write_config(tmp_path, "io", tiny_model_dir, base_url="http://127.0.0.1:9", max_steps=1)
    root = run_dir_of(config)
    write_batch(root / "rollouts" / "step_1", 0, PackedBatch.empty(4, 128))
    env = {**os.environ, "PRIMEJAX_FAULTS": f"trainer.export@1={fault}"}
    proc = subprocess.run([sys.executable, "-m", "primejax.trainer", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env, start_new_session=True)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    where = root / "broadcasts" / "step_1"
    assert last == f"error: trainer: I/O error writing its outputs under {where}: Input/output error", last
    assert "Traceback" not in proc.stderr


def test_a_background_launcher_stops_on_sigint_and_says_how_to_go_on(tiny_model_dir, tmp_path):
    """Issue 48: a launcher started in the background (`nohup ... &`: the shell leaves SIGINT ignored) ignored
    SIGINT entirely, and Ctrl-C printed `interrupted ()`. Here the launcher starts with SIGINT ignored, as
    from such a shell; a SIGINT once its children run stops them all, names the signal and gives the hint."""
    config = write_config(tmp_path, "bg", tiny_model_dir, base_url="http://127.0.0.1:9")
    proc = subprocess.Popen(
        [sys.executable, "-m", "primejax.train", "--config", str(config)], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        for line in proc.stdout:  # the launcher says when its children run
            if "started (logs in" in line:
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "primejax: interrupted (SIGINT); stopping all processes." in err, err
    assert "no checkpoint was written yet: rerunning the same command starts over" in err, err
    assert_no_survivors(run_dir_of(config))
