"""Run directories: one live run each, a port checked before anything moves, names that cannot point at a
project, and a fresh start that moves only what primejax created. In-process launcher calls that stop at
the checks (the model path does not exist, so nothing could start even if a check were missing)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from primejax.config import ConfigError, default_config, typed
from primejax.launcher.launch import launch
from primejax.launcher.resume import keep_previous_run


def _cfg(tmp_path, **changes):
    c = default_config()
    c.model.path = str(tmp_path / "no-model")
    c.run.output_dir = str(tmp_path / "runs")
    c.run.name = "r"
    c.inference.port = 0  # the checks under test come before and after the port check; 8000 may be busy here
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[last] = value
    return typed(c)


def _one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    return err[0]


def test_second_launcher_on_a_live_run_dir_is_refused_and_moves_nothing(tmp_path, capsys):
    root = tmp_path / "runs" / "r"
    (root / "rollouts" / "step_1").mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from primejax.launcher.runlock import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); sys.stdin.read()",
            str(root),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert launch(_cfg(tmp_path)) == 2
        line = _one_error_line(capsys)
        assert (
            line.startswith("error: run.name:")
            and "in use by a live run" in line
            and f"pid {holder.pid}" in line
        )
        assert (root / "rollouts" / "step_1").is_dir() and not (root / "previous").exists()
    finally:
        holder.stdin.close()
        holder.wait(30)
    # The lock dies with its holder: the next launcher gets past it (and stops at the missing model).
    assert launch(_cfg(tmp_path)) == 2
    assert "model.path" in _one_error_line(capsys)


def test_busy_port_is_refused_before_anything_moves(tmp_path, capsys):
    root = tmp_path / "runs" / "r"
    (root / "metrics").mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert launch(_cfg(tmp_path, **{"inference.port": port})) == 2
    line = _one_error_line(capsys)
    assert line.startswith("error: inference.port:") and f"127.0.0.1:{port} is already in use" in line
    assert (root / "metrics").is_dir() and not (root / "previous").exists()


def test_a_symlinked_run_lock_is_not_followed(tmp_path):
    """Issue 48: `<run>/.lock` planted as a symlink was followed, and its target truncated and overwritten with
    the launcher's pid line."""
    from primejax.launcher.preflight import PreflightError
    from primejax.launcher.runlock import RunLock

    root = tmp_path / "run"
    root.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (root / ".lock").symlink_to(target)
    with pytest.raises(PreflightError, match=r"\.lock: cannot be the run's lock file .*a symlink\?"):
        RunLock(root).acquire()
    assert target.read_text() == "keep me"


def test_an_explicit_port_is_reserved_for_the_launchers_life(tmp_path):
    """Issue 48: run B, started while run A's server was still starting on the same explicit port (nothing bound
    yet), passed the bind check and started a second vLLM. The port is now reserved host-wide by the launcher
    that checked it first: B is refused at once, naming A; once A exits the port is B's."""
    import subprocess
    import sys

    from primejax.inference.server import free_port
    from primejax.launcher.preflight import PreflightError
    from primejax.launcher.runlock import check_port, release_ports

    port = free_port()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from primejax.launcher.runlock import check_port; "
         f"check_port('127.0.0.1', {port}); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            PreflightError,
            match=rf"^inference.port: 127.0.0.1:{port} is reserved by another "
            rf"primejax run \(pid {holder.pid}, started ",
        ):
            check_port("127.0.0.1", port)
    finally:
        holder.stdin.close()
        holder.wait(30)
    try:
        assert check_port("127.0.0.1", port) == port  # A is gone: the kernel dropped its reservation
    finally:
        release_ports()


def test_port_zero_means_a_free_port(tmp_path):
    from primejax.launcher.runlock import check_port

    assert _cfg(tmp_path, **{"inference.port": 0}).inference.port == 0
    port = check_port("127.0.0.1", 0)
    assert 0 < port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("name", [".", "..", "/", "~", "~user", "a/b", "a\\b", "-rf", ".hidden", ""])
def test_run_names_that_are_not_one_plain_directory_are_rejected(tmp_path, name):
    with pytest.raises(ConfigError, match="^run.name: "):
        _cfg(tmp_path, **{"run.name": name})


@pytest.mark.parametrize("output_dir", ["/", "~", "~/runs", "/../.."])
def test_output_dirs_at_the_filesystem_root_or_home_shorthand_are_rejected(tmp_path, output_dir):
    with pytest.raises(ConfigError, match="^run.output_dir: "):
        _cfg(tmp_path, **{"run.output_dir": output_dir})


def test_keep_previous_run_moves_only_what_primejax_created(tmp_path):
    for d in (".git", "src", "rollouts", "logs", "metrics"):
        (tmp_path / d).mkdir()
    (tmp_path / "README.md").write_text("a project")
    (tmp_path / "pids.json").write_text("{}")
    kept = keep_previous_run(tmp_path)
    assert sorted(p.name for p in kept.iterdir()) == ["logs", "metrics", "pids.json", "rollouts"]
    assert (tmp_path / ".git").is_dir() and (tmp_path / "src").is_dir() and (tmp_path / "README.md").is_file()
    assert keep_previous_run(tmp_path) is None  # nothing of primejax's left to keep


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_refused_second_launcher_leaves_the_live_runs_recorded_config(tmp_path, dry_run):
    import os
    from pathlib import Path

    root = tmp_path / "runs" / "r"
    (root / "configs").mkdir(parents=True)
    record = root / "configs" / "train.json"
    record.write_text('{"live": true}')
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from primejax.launcher.runlock import RunLock; "
            "RunLock(sys.argv[1]).acquire(); print('held', flush=True); sys.stdin.read()",
            str(root),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "primejax.train",
                "--config",
                "configs/debug.py",
                f"--config.run.output_dir={tmp_path / 'runs'}",
                "--config.run.name=r",
                *(["--dry_run"] if dry_run else []),
            ],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        assert proc.returncode == (0 if dry_run else 2), proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        if dry_run:  # the dry run still prints its config and checks the environments
            assert any("in use by a live run" in ln for ln in lines), lines
        else:
            assert "in use by a live run" in lines[-1]
        assert record.read_text() == '{"live": true}'
    finally:
        holder.stdin.close()
        holder.wait(30)
