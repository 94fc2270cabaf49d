"""The monitor writes TensorBoard event files that a reader can parse, and the same scalars as JSONL."""

from __future__ import annotations

import numpy as np

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
