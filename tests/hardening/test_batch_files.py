"""Hostile or damaged batch files: BatchFormatError naming the file and field, checked from headers before any
array is loaded; samples' segment ids and positions consistent; max_segments computed, not trusted."""

from __future__ import annotations

import io
import json
import tracemalloc

import numpy as np
import pytest

from primejax.contracts.batch import (
    MANIFEST_KEY,
    BatchFormatError,
    TrainingSample,
    _sha256,
    pack_samples,
    read_batch,
    write_batch,
)


def _good(tmp_path):
    samples = [
        TrainingSample(
            [1, 2, 3, 4], [False, True, True, True], [0.0, -0.1, -0.2, -0.3], advantages=[1.0] * 4
        ),
        TrainingSample([5, 6, 7], [False, True, True], [0.0, -0.4, -0.5], advantages=[-1.0] * 3),
    ]
    (batch,) = pack_samples(samples, seq_len=16)
    return write_batch(tmp_path / "ok", 0, batch)


def _rewrite(path, out, manifest_fn=None, arrays_fn=None, compressed=False):
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files if k != MANIFEST_KEY}
        manifest = json.loads(data[MANIFEST_KEY].tobytes())
    if arrays_fn:
        arrays_fn(arrays)
        for name, a in arrays.items():
            manifest["fields"][name]["sha256"] = _sha256(a)
    if manifest_fn:
        manifest = manifest_fn(manifest)
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(
        buf, **arrays, **{MANIFEST_KEY: np.frombuffer(json.dumps(manifest).encode(), np.uint8)}
    )
    out.write_bytes(buf.getvalue())
    return out


def _set(key, value):
    def fn(m):
        node = m
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
        return m

    return fn


@pytest.mark.parametrize(
    ("manifest_fn", "field"),
    [
        (lambda m: [m], "__manifest__"),
        (_set("fields", []), "fields"),
        (_set("meta", "x"), "meta"),
        (_set("fields.tokens", 3), "fields.tokens"),
        (_set("meta.max_segments", "2"), "meta.max_segments"),
        (_set("meta.max_segments", 1.5), "meta.max_segments"),
        (_set("rows", 0), "rows"),
        (_set("seq_len", "16"), "seq_len"),
    ],
)
def test_malformed_manifest_names_file_and_field(tmp_path, manifest_fn, field):
    bad = _rewrite(_good(tmp_path), tmp_path / "bad.npz", manifest_fn=manifest_fn)
    with pytest.raises(BatchFormatError) as err:
        read_batch(bad)
    assert str(bad) in str(err.value) and field in str(err.value), err.value


def test_a_manifest_nested_too_deeply_is_a_format_error(tmp_path):
    """Issue 48: json's RecursionError escaped read_batch, and the trainer ended in a traceback."""
    good = _good(tmp_path)
    with np.load(good) as data:
        arrays = {k: data[k] for k in data.files if k != MANIFEST_KEY}
    buf = io.BytesIO()
    np.savez(buf, **arrays, **{MANIFEST_KEY: np.frombuffer(b"[" * 100_000, np.uint8)})
    bad = tmp_path / "deep.npz"
    bad.write_bytes(buf.getvalue())
    with pytest.raises(BatchFormatError, match="nested too deeply"):
        read_batch(bad)


def test_zero_rows_is_a_format_error(tmp_path):
    def empty(arrays):
        for k in arrays:
            arrays[k] = arrays[k][:0]

    bad = _rewrite(_good(tmp_path), tmp_path / "bad.npz", arrays_fn=empty, manifest_fn=_set("rows", 0))
    with pytest.raises(BatchFormatError, match="rows"):
        read_batch(bad)


def test_a_huge_declared_array_is_rejected_from_its_header_without_allocating(tmp_path):
    def huge(arrays):
        arrays["advantages"] = np.zeros((4000, 4000), np.float32)  # 64 MB of zeros, ~60 kB compressed

    bad = _rewrite(_good(tmp_path), tmp_path / "bad.npz", arrays_fn=huge, compressed=True)
    assert bad.stat().st_size < 1_000_000
    tracemalloc.start()
    try:
        with pytest.raises(BatchFormatError) as err:
            read_batch(bad)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "advantages" in str(err.value) or "compressed" in str(err.value)
    assert peak < 8_000_000, f"read_batch allocated {peak / 1e6:.0f} MB before rejecting the file"


def test_positions_must_restart_at_zero_per_sample(tmp_path):
    def shift(arrays):
        arrays["positions"][0, 4] = 7  # the second sample's first token

    bad = _rewrite(_good(tmp_path), tmp_path / "bad.npz", arrays_fn=shift)
    with pytest.raises(BatchFormatError, match="positions"):
        read_batch(bad)


def test_segment_ids_must_be_contiguous(tmp_path):
    def renumber(arrays):
        seg = arrays["segment_ids"][0]
        seg[seg == 2] = 3

    bad = _rewrite(_good(tmp_path), tmp_path / "bad.npz", arrays_fn=renumber)
    with pytest.raises(BatchFormatError, match="segment_ids"):
        read_batch(bad)


def test_max_segments_is_computed_not_trusted(tmp_path):
    bad = _rewrite(_good(tmp_path), tmp_path / "bad.npz", manifest_fn=_set("meta.max_segments", 1))
    assert read_batch(bad).meta["max_segments"] == 2


@pytest.mark.parametrize("field", ["inference_logprobs", "ref_logprobs"])
def test_a_positive_log_probability_is_refused(tmp_path, field):
    """Issue 48: a batch whose inference_logprobs were positive (not a log-probability) was trained on."""

    def poison(arrays):
        arrays[field] = arrays[field].copy()
        arrays[field][0, 1] = 5.0

    bad = _rewrite(_good(tmp_path), tmp_path / "bad.npz", arrays_fn=poison)
    with pytest.raises(BatchFormatError, match=rf"{field}.*a log-probability above 0 \(max 5\)"):
        read_batch(bad)


def test_the_writer_runs_the_readers_value_checks(tmp_path):
    samples = [
        TrainingSample([1, 2, 3], [False, True, True], [0.0, -0.1, float("nan")], advantages=[1.0] * 3)
    ]
    (batch,) = pack_samples(samples, seq_len=8)
    with pytest.raises(BatchFormatError, match="inference_logprobs"):
        write_batch(tmp_path / "w", 0, batch)
    assert not (tmp_path / "w" / "rank_0.npz").exists()
