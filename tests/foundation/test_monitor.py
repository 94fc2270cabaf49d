"""The monitor writes TensorBoard event files that a reader can parse, and the same scalars as JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from wandb_files import wandb_history, wandb_run

from primejax.utils.monitor import Monitor, read_jsonl


def _read_events_raw(logdir):
    """Parse the event files with tensorboardX's own protobufs (no tensorboard package needed)."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars, hist, text = {}, set(), set()
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            payload = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            event = event_pb2.Event.FromString(payload)
            for v in event.summary.value:
                if v.HasField("histo"):
                    hist.add(v.tag)
                elif v.HasField("simple_value"):
                    scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
                else:
                    text.add(v.tag)
    return scalars, hist, text


def test_scalars_histograms_text_round_trip(tmp_path):
    with Monitor(tmp_path, "trainer") as m:
        for step in range(1, 4):
            m.scalars(step, {"loss": 1.0 / step, "reward/mean": np.float32(0.5 * step)})
        m.histogram(3, "advantages", np.linspace(-1, 1, 50))
        m.text(3, "sample", "hello")
    scalars, hist, text = _read_events_raw(tmp_path / "tensorboard" / "trainer")
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in scalars["loss"]], [1.0, 0.5, 1 / 3], rtol=1e-6)
    np.testing.assert_allclose([v for _, v in scalars["reward/mean"]], [0.5, 1.0, 1.5], rtol=1e-6)
    assert "advantages" in hist
    assert any(t.startswith("sample") for t in text)
    rows = read_jsonl(tmp_path / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["reward/mean"] == 1.5


def test_jsonl_keeps_non_finite_as_null_and_skips_torn_lines(tmp_path):
    with Monitor(tmp_path, "orchestrator", tensorboard=False) as m:
        m.scalars(1, {"loss": float("nan")})
    path = tmp_path / "metrics" / "orchestrator.jsonl"
    with path.open("a") as f:
        f.write('{"step": 2, "lo')  # a writer killed mid-line
    rows = read_jsonl(path)
    assert rows == [{"step": 1, "time": rows[0]["time"], "loss": None}]


def test_table_is_tensorboard_text_and_jsonl_rows_with_hostile_cells_cut(tmp_path):
    huge = "x" * 50_000  # an env may return megabytes: the cell is cut, the row is kept
    with Monitor(tmp_path, "orchestrator") as m:
        m.table(
            4,
            "samples",
            ["env", "reward", "completion"],
            [["rev", 0.5, "a\n```b"], ["rev", float("nan"), huge]],
        )
    rows = read_jsonl(tmp_path / "tables" / "orchestrator" / "samples.jsonl")
    assert [(r["step"], r["env"], r["reward"]) for r in rows] == [(4, "rev", 0.5), (4, "rev", None)]
    assert rows[0]["completion"] == "a\n```b"
    assert len(rows[1]["completion"]) < 20_100 and rows[1]["completion"].endswith("[30000 more characters]")
    _, _, text = _read_events_raw(tmp_path / "tensorboard" / "orchestrator")
    assert any(t.startswith("samples") for t in text)


def test_run_info_records_the_config_and_git_commit(tmp_path):
    import subprocess

    with Monitor(tmp_path, "trainer", run_config={"run": {"name": "x"}}) as m:
        m.scalars(1, {"loss": 1.0})
    info = json.loads((tmp_path / "metrics" / "trainer.run.json").read_text())
    assert info["config"] == {"run": {"name": "x"}} and info["process"] == "trainer"
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    assert info["git"].get("commit") == (head or None)  # this checkout's commit (or none outside git)
    _, _, text = _read_events_raw(tmp_path / "tensorboard" / "trainer")
    assert {"run/git", "run/config"} <= {t.split("/text_summary")[0] for t in text}


def test_wandb_offline_run_holds_every_metric_the_other_sinks_hold(tmp_path):
    pytest.importorskip("wandb")
    from primejax.utils.monitor import MonitorConfig

    cfg = MonitorConfig(wandb=True, wandb_mode="offline")
    with Monitor.from_config(tmp_path, "orchestrator", cfg, {"run": {"name": tmp_path.name}}) as m:
        for step in (1, 2):
            m.scalars(step, {"reward/mean": 0.25 * step, "server/0/gen_tokens_per_s": 100.0 * step})
        m.histogram(2, "advantage", [0.1, -0.1, float("nan")])
        m.table(2, "samples", ["env", "reward"], [["rev", 0.5]])
    by_step = wandb_history(tmp_path)
    assert (
        float(by_step[1]["reward/mean"]) == 0.25 and float(by_step[2]["server/0/gen_tokens_per_s"]) == 200.0
    )
    assert json.loads(by_step[2]["advantage/_type"]) == "histogram"
    assert json.loads(by_step[2]["samples/_type"]) == "table-file"
    run = wandb_run(tmp_path)
    assert (run.run_group, run.display_name, run.job_type) == (
        tmp_path.name,
        f"{tmp_path.name}/orchestrator",
        "orchestrator",
    )
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["run"] == {"name": tmp_path.name} and config["process"] == "orchestrator"
    assert "git_commit" in config
